// K-quant weights (GGUF Q4_K, Q5_K, Q6_K) with float activations: y = x @ W^T from the weights' own
// superblocks of 256, repacked into tiles of 16 output rows with the same bytes per weight (4.5, 5.5 and
// 6.5625 bits), x kept in float32 (bfloat16 x is widened, which is exact). The result is the dequantized
// weight's product (gguf.quants.dequantize) up to float32 rounding, as qlinear_float.cpp gives for
// q4_1 / q8_0.
//
// Tiled layout (kiln/model/quant.py builds it; T tiles of 16 rows, S = K / 256 superblocks, r = row in
// the tile). qs [T, S, 8 * QB]: group j (K values 32j..32j+31 of the superblock) at j * QB:
//   bytes [0, 256): byte c*64 + r*4 + i holds code 4c+i of row r in its low nibble and 16+4c+i in the high
//     one (qlinear's q4_1 layout; for Q5_K / Q6_K these are the codes' low 4 bits);
//   Q5_K, bytes [256, 320): byte r*4 + i, bit c = bit 4 of code 4c+i, bit 4+c = bit 4 of code 16+4c+i;
//   Q6_K, bytes [256, 384): byte 256 + h*64 + r*4 + i, bits 2c..2c+1 = bits 4..5 of code 16h+4c+i.
// QB = 256, 320, 384. scales [T, S, SB] bytes:
//   Q4_K / Q5_K (SB 256): the 16 rows' float16 d, then their float16 dmin, then the 12 bytes of 6-bit
//     scales and mins of each row, byte b of row r at 64 + b*16 + r (GGUF's packing within a row);
//   Q6_K (SB 288): the 16 rows' float16 d, then the int8 scale of each 16 values, scale k of row r at
//     32 + k*16 + r.
//
// Every output is one fixed sequence of float32 operations, whatever M, the row block, the thread or the
// ISA (vector lanes are output rows, never K), so the three code paths give the same bits and a row's
// result never depends on its batch. Per output row and activation row, per group g of 32 K values in
// order, with q the integer code (Q6_K: code - 32) converted to float exactly:
//   lo = fma(q[4c+i], x[4c+i], lo), hi = fma(q[16+4c+i], x[16+4c+i], hi)   for c = 0..3, i = 0..3
//   Q4_K / Q5_K: acc = fma(d * sc[g], lo + hi, acc); acc = fma(-(dmin * m[g]), X[g], acc)
//   Q6_K:        acc = fma(d * sc[2g], lo, acc);     acc = fma(d * sc[2g+1], hi, acc)
// (d * sc and dmin * m are exact in float32), X[g] the group's activations summed in K order; the bias
// is added last.

#include "qlinear_kquant.h"

#include "isa.h"
#include "kquant_tiles.h"
#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kiln::half_bits_to_float;
using namespace kiln::kq;

constexpr int kMaxMB = 4;

struct Problem {
  int64_t fmt, M, N, S;
  const uint8_t* qs;      // [T, S, super_bytes]
  const uint8_t* sc;      // [T, S, scale_bytes]
  const float* x;         // [M, S * 256] float32
  const float* xsum;      // [M, S * 8] each group's activations summed in K order
  const float* bias;      // [T * 16] or nullptr
  void* out;              // [M, N]
  bool out_bf16;
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  store_tile_row(p.out, p.out_bf16, p.N, p.bias, m, t, acc);
}

// ---------------------------------------------------------------- scalar reference

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  const int f = static_cast<int>(p.fmt);
  const int64_t QS = super_bytes(f), SB = scale_bytes(f), Kp = p.S * kSuper;
  for (int64_t jr = 0; jr < mb; ++jr) {
    const int64_t m = m0 + jr;
    float acc[kRows] = {};
    for (int64_t s = 0; s < p.S; ++s) {
      const uint8_t* sb = p.sc + (t * p.S + s) * SB;
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qg = p.qs + (t * p.S + s) * QS + j * group_bytes(f);
        const float* xg = p.x + m * Kp + s * kSuper + j * kGroup;
        for (int r = 0; r < kRows; ++r) {
          float lo = 0.0f, hi = 0.0f;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              lo = std::fma(code_scalar(f, qg, r, 4 * c + i), xg[4 * c + i], lo);
              hi = std::fma(code_scalar(f, qg, r, 16 + 4 * c + i), xg[16 + 4 * c + i], hi);
            }
          const float d = half_bits_to_float(load_u16(sb + 2 * r));
          if (f == Q6K) {
            const float s0 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j) * 16 + r]));
            const float s1 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j + 1) * 16 + r]));
            acc[r] = std::fma(s0, lo, acc[r]);
            acc[r] = std::fma(s1, hi, acc[r]);
          } else {
            int sc, mn;
            scale_min_scalar(sb, r, j, sc, mn);
            const float dmin = half_bits_to_float(load_u16(sb + 32 + 2 * r));
            acc[r] = std::fma(d * static_cast<float>(sc), lo + hi, acc[r]);
            acc[r] = std::fma(-(dmin * static_cast<float>(mn)), p.xsum[m * p.S * 8 + s * 8 + j], acc[r]);
          }
        }
      }
    }
    store(p, m, t, acc);
  }
}

#ifdef KILN_KQ_X86

// The float codes of K index 4c+i (wl) and 16+4c+i (wh).
template <int F>
KILN_KQ_AVX512 inline void code_floats_avx512(__m512i lo, __m512i hi, int i, __m512& wl, __m512& wh) {
  if (F == Q4K) {
    // vpermps reads the low 4 bits of each index: the nibble's float from a table (qlinear_float's way)
    const __m512 nib = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    wl = _mm512_permutexvar_ps(i == 0 ? lo : _mm512_srli_epi32(lo, 8 * i), nib);
    wh = _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 8 * i + 4), nib);
  } else if (F == Q5K) {
    // vpermt2ps reads the low 5 bits: a 32-entry table
    const __m512 t0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t1 = _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    wl = _mm512_permutex2var_ps(t0, i == 0 ? lo : _mm512_srli_epi32(lo, 8 * i), t1);
    wh = _mm512_permutex2var_ps(t0, i == 0 ? hi : _mm512_srli_epi32(hi, 8 * i), t1);
  } else {
    // byte i of each dword to its top, then an arithmetic shift brings it down sign-extended
    const __m512i top = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(0x00808080u) | (i << 24)),
                                         _mm512_set4_epi32(0x0C000000, 0x08000000, 0x04000000, 0));
    wl = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_shuffle_epi8(lo, top), 24));
    wh = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_shuffle_epi8(hi, top), 24));
  }
}

template <int F, int NT, int MB>
KILN_KQ_AVX512 void tiles_avx512(const Problem& p, int64_t t, int64_t m0, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t Kp = p.S * kSuper;
  __m512 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < p.S; ++s) {
    __m512 f0[NT][8], f1[NT][8];
    for (int a = 0; a < NT; ++a) scales_avx512<F>(p.sc + ((t + a) * p.S + s) * SB, f0[a], f1[a]);
    for (int g = 0; g < 8; ++g) {
      for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, p.S, t + a, s, g, NT);
      __m512 lo[NT][MB], hi[NT][MB];
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) lo[a][j] = hi[a][j] = _mm512_setzero_ps();
      // unrolled by hand's order: GCC left the c loop rolled, its chains in memory (1.4x slower)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i vl[NT], vh[NT];
        for (int a = 0; a < NT; ++a) codes_avx512<F>(p.qs + ((t + a) * p.S + s) * QS + g * QB, c, vl[a], vh[a]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          for (int a = 0; a < NT; ++a) {
            __m512 wl, wh;
            code_floats_avx512<F>(vl[a], vh[a], i, wl, wh);
            for (int j = 0; j < MB; ++j) {
              const float* xg = p.x + (m0 + j) * Kp + s * kSuper + g * kGroup;
              lo[a][j] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xg[4 * c + i]), lo[a][j]);
              hi[a][j] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xg[16 + 4 * c + i]), hi[a][j]);
            }
          }
      }
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) {
          if (F == Q6K) {
            acc[a][j] = _mm512_fmadd_ps(f0[a][g], lo[a][j], acc[a][j]);
            acc[a][j] = _mm512_fmadd_ps(f1[a][g], hi[a][j], acc[a][j]);
          } else {
            acc[a][j] = _mm512_fmadd_ps(f0[a][g], _mm512_add_ps(lo[a][j], hi[a][j]), acc[a][j]);
            acc[a][j] = _mm512_fmadd_ps(f1[a][g], _mm512_set1_ps(p.xsum[(m0 + j) * p.S * 8 + s * 8 + g]), acc[a][j]);
          }
        }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out[a][j], acc[a][j]);
}

// ------------------------------------------------------------ AVX2: half h of a tile (8 rows) a vector

template <int F>
KILN_KQ_AVX2 inline void code_floats_avx2(__m256i lo, __m256i hi, int i, __m256& wl, __m256& wh) {
  if (F != Q6K) {
    // byte i of each row's dword to its bottom, zero-extended (qlinear_float's codes_at_avx2)
    const __m256i pick = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(0x80808000u) | i),
                                          _mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12));
    wl = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, pick));
    wh = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, pick));
  } else {
    const __m256i top = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(0x00808080u) | (i << 24)),
                                         _mm256_setr_epi32(0, 0x04000000, 0x08000000, 0x0C000000, 0, 0x04000000,
                                                           0x08000000, 0x0C000000));
    wl = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(lo, top), 24));
    wh = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(hi, top), 24));
  }
}

template <int F, int NT, int MB>
KILN_KQ_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0, int h, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t Kp = p.S * kSuper;
  __m256 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < p.S; ++s) {
    __m256 f0[NT][8], f1[NT][8];
    for (int a = 0; a < NT; ++a) scales_avx2<F>(p.sc + ((t + a) * p.S + s) * SB, h, f0[a], f1[a]);
    for (int g = 0; g < 8; ++g) {
      if (h == 0)
        for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, p.S, t + a, s, g, NT);
      __m256 lo[NT][MB], hi[NT][MB];
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) lo[a][j] = hi[a][j] = _mm256_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i vl[NT], vh[NT];
        for (int a = 0; a < NT; ++a) codes_avx2<F>(p.qs + ((t + a) * p.S + s) * QS + g * QB, c, h, vl[a], vh[a]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          for (int a = 0; a < NT; ++a) {
            __m256 wl, wh;
            code_floats_avx2<F>(vl[a], vh[a], i, wl, wh);
            for (int j = 0; j < MB; ++j) {
              const float* xg = p.x + (m0 + j) * Kp + s * kSuper + g * kGroup;
              lo[a][j] = _mm256_fmadd_ps(wl, _mm256_broadcast_ss(xg + 4 * c + i), lo[a][j]);
              hi[a][j] = _mm256_fmadd_ps(wh, _mm256_broadcast_ss(xg + 16 + 4 * c + i), hi[a][j]);
            }
          }
      }
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) {
          if (F == Q6K) {
            acc[a][j] = _mm256_fmadd_ps(f0[a][g], lo[a][j], acc[a][j]);
            acc[a][j] = _mm256_fmadd_ps(f1[a][g], hi[a][j], acc[a][j]);
          } else {
            acc[a][j] = _mm256_fmadd_ps(f0[a][g], _mm256_add_ps(lo[a][j], hi[a][j]), acc[a][j]);
            acc[a][j] = _mm256_fmadd_ps(f1[a][g], _mm256_set1_ps(p.xsum[(m0 + j) * p.S * 8 + s * 8 + g]), acc[a][j]);
          }
        }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm256_storeu_ps(out[a][j] + 8 * h, acc[a][j]);
}

// ------------------------------------------------------------ many rows: a superblock's codes as floats
//
// Prompts (more than 4 activation rows): each superblock of a tile is unpacked once into a per-thread
// panel of float codes (16 KB, L1) and its scale factors, and every row block multiplies from the panel,
// instead of extracting the codes again per block of 4 rows. The running sums live in a buffer (touched
// once per group of 32). Every output gets the operations of tiles_avx512 / tiles_avx2 in their order,
// so the same bits.

struct Panel {
  alignas(64) float w[8][kGroup][kRows];   // [group][K index][row]
  alignas(64) float f0[8][kRows], f1[8][kRows];
};

template <int F>
KILN_KQ_AVX512 void unpack_avx512(const Problem& p, int64_t t, int64_t s, Panel& pn) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  __m512 f0[8], f1[8];
  scales_avx512<F>(p.sc + (t * p.S + s) * SB, f0, f1);
  for (int g = 0; g < 8; ++g) {
    _mm512_store_ps(pn.f0[g], f0[g]);
    _mm512_store_ps(pn.f1[g], f1[g]);
    const uint8_t* qg = p.qs + (t * p.S + s) * QS + g * QB;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i vl, vh;
      codes_avx512<F>(qg, c, vl, vh);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m512 wl, wh;
        code_floats_avx512<F>(vl, vh, i, wl, wh);
        _mm512_store_ps(pn.w[g][4 * c + i], wl);
        _mm512_store_ps(pn.w[g][16 + 4 * c + i], wh);
      }
    }
  }
}

template <int F, int MB>
KILN_KQ_AVX512 void panel_rows_avx512(const Problem& p, int64_t s, int64_t m0, const Panel& pn, float* acc) {
  const int64_t Kp = p.S * kSuper;
  for (int g = 0; g < 8; ++g) {
    __m512 lo[MB], hi[MB];
    for (int j = 0; j < MB; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) {
      const __m512 wl = _mm512_load_ps(pn.w[g][k]), wh = _mm512_load_ps(pn.w[g][16 + k]);
      for (int j = 0; j < MB; ++j) {
        const float* xg = p.x + (m0 + j) * Kp + s * kSuper + g * kGroup;
        lo[j] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xg[k]), lo[j]);
        hi[j] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xg[16 + k]), hi[j]);
      }
    }
    const __m512 f0 = _mm512_load_ps(pn.f0[g]), f1 = _mm512_load_ps(pn.f1[g]);
    for (int j = 0; j < MB; ++j) {
      float* a = acc + (m0 + j) * kRows;
      __m512 v = _mm512_loadu_ps(a);
      if (F == Q6K) {
        v = _mm512_fmadd_ps(f0, lo[j], v);
        v = _mm512_fmadd_ps(f1, hi[j], v);
      } else {
        v = _mm512_fmadd_ps(f0, _mm512_add_ps(lo[j], hi[j]), v);
        v = _mm512_fmadd_ps(f1, _mm512_set1_ps(p.xsum[(m0 + j) * p.S * 8 + s * 8 + g]), v);
      }
      _mm512_storeu_ps(a, v);
    }
  }
}

template <int F>
KILN_KQ_AVX2 void unpack_avx2(const Problem& p, int64_t t, int64_t s, Panel& pn) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  for (int h = 0; h < 2; ++h) {
    __m256 f0[8], f1[8];
    scales_avx2<F>(p.sc + (t * p.S + s) * SB, h, f0, f1);
    for (int g = 0; g < 8; ++g) {
      _mm256_store_ps(pn.f0[g] + 8 * h, f0[g]);
      _mm256_store_ps(pn.f1[g] + 8 * h, f1[g]);
      const uint8_t* qg = p.qs + (t * p.S + s) * QS + g * QB;
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i vl, vh;
        codes_avx2<F>(qg, c, h, vl, vh);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          __m256 wl, wh;
          code_floats_avx2<F>(vl, vh, i, wl, wh);
          _mm256_store_ps(pn.w[g][4 * c + i] + 8 * h, wl);
          _mm256_store_ps(pn.w[g][16 + 4 * c + i] + 8 * h, wh);
        }
      }
    }
  }
}

template <int F, int MB>
KILN_KQ_AVX2 void panel_rows_avx2(const Problem& p, int64_t s, int64_t m0, const Panel& pn, float* acc) {
  const int64_t Kp = p.S * kSuper;
  for (int g = 0; g < 8; ++g)
    for (int h = 0; h < 2; ++h) {
      __m256 lo[MB], hi[MB];
      for (int j = 0; j < MB; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        const __m256 wl = _mm256_load_ps(pn.w[g][k] + 8 * h), wh = _mm256_load_ps(pn.w[g][16 + k] + 8 * h);
        for (int j = 0; j < MB; ++j) {
          const float* xg = p.x + (m0 + j) * Kp + s * kSuper + g * kGroup;
          lo[j] = _mm256_fmadd_ps(wl, _mm256_broadcast_ss(xg + k), lo[j]);
          hi[j] = _mm256_fmadd_ps(wh, _mm256_broadcast_ss(xg + 16 + k), hi[j]);
        }
      }
      const __m256 f0 = _mm256_load_ps(pn.f0[g] + 8 * h), f1 = _mm256_load_ps(pn.f1[g] + 8 * h);
      for (int j = 0; j < MB; ++j) {
        float* a = acc + (m0 + j) * kRows + 8 * h;
        __m256 v = _mm256_loadu_ps(a);
        if (F == Q6K) {
          v = _mm256_fmadd_ps(f0, lo[j], v);
          v = _mm256_fmadd_ps(f1, hi[j], v);
        } else {
          v = _mm256_fmadd_ps(f0, _mm256_add_ps(lo[j], hi[j]), v);
          v = _mm256_fmadd_ps(f1, _mm256_set1_ps(p.xsum[(m0 + j) * p.S * 8 + s * 8 + g]), v);
        }
        _mm256_storeu_ps(a, v);
      }
    }
}

template <int F>
void run_panel_x86(const Problem& p, int64_t t0, int64_t t1, bool avx512) {
  thread_local std::vector<float> acc_buf;
  thread_local Panel pn;
  acc_buf.resize(static_cast<size_t>(p.M * kRows));
  float* acc = acc_buf.data();
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc, acc + p.M * kRows, 0.0f);
    for (int64_t s = 0; s < p.S; ++s) {
      if (avx512) unpack_avx512<F>(p, t, s, pn);
      else unpack_avx2<F>(p, t, s, pn);
      int64_t m0 = 0;
      if (avx512) {
        for (; m0 + kMaxMB <= p.M; m0 += kMaxMB) panel_rows_avx512<F, kMaxMB>(p, s, m0, pn, acc);
        switch (p.M - m0) {
          case 1: panel_rows_avx512<F, 1>(p, s, m0, pn, acc); break;
          case 2: panel_rows_avx512<F, 2>(p, s, m0, pn, acc); break;
          case 3: panel_rows_avx512<F, 3>(p, s, m0, pn, acc); break;
          default: break;
        }
      } else {
        for (; m0 + 3 <= p.M; m0 += 3) panel_rows_avx2<F, 3>(p, s, m0, pn, acc);
        if (p.M - m0 == 2) panel_rows_avx2<F, 2>(p, s, m0, pn, acc);
        if (p.M - m0 == 1) panel_rows_avx2<F, 1>(p, s, m0, pn, acc);
      }
    }
    for (int64_t m = 0; m < p.M; ++m) store(p, m, t, acc + m * kRows);
  }
}

// Tiles [t0, t1) for every activation row, in blocks of up to 4 rows: one row reads several tiles side
// by side (independent chains hide the FMA latency), more rows share each unpacked code vector.
template <int F>
void run_x86(const Problem& p, int64_t t0, int64_t t1, bool avx512) {
  float out[4][kMaxMB][kRows];
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
    const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
    const int want = avx512 ? (mb == 1 ? 4 : mb == 2 ? 2 : 1) : (mb == 1 ? 2 : 1);
    for (int64_t t = t0; t < t1;) {
      const int nt = t1 - t >= want ? want : 1;
      if (avx512) {
        if (nt == 4) tiles_avx512<F, 4, 1>(p, t, m0, out);
        else if (nt == 2) tiles_avx512<F, 2, 2>(p, t, m0, out);
        else if (mb == 1) tiles_avx512<F, 1, 1>(p, t, m0, out);
        else if (mb == 2) tiles_avx512<F, 1, 2>(p, t, m0, out);
        else if (mb == 3) tiles_avx512<F, 1, 3>(p, t, m0, out);
        else tiles_avx512<F, 1, 4>(p, t, m0, out);
      } else {
        for (int h = 0; h < 2; ++h) {
          if (nt == 2) tiles_avx2<F, 2, 1>(p, t, m0, h, out);
          else if (mb == 1) tiles_avx2<F, 1, 1>(p, t, m0, h, out);
          else if (mb == 2) tiles_avx2<F, 1, 2>(p, t, m0, h, out);
          else if (mb == 3) tiles_avx2<F, 1, 3>(p, t, m0, h, out);
          else tiles_avx2<F, 1, 4>(p, t, m0, h, out);
        }
      }
      for (int a = 0; a < nt; ++a)
        for (int j = 0; j < mb; ++j) store(p, m0 + j, t + a, out[a][j]);
      t += nt;
    }
  }
}
#endif

enum Path { SCALAR, AVX2, AVX512 };

Path path_for(int64_t isa) {
  if (isa >= kiln::ISA_AVX512) return AVX512;
  if (isa >= kiln::ISA_AVX2) return AVX2;
  return SCALAR;
}

torch::Tensor qlinear_kquant_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                int64_t fmt, int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                bool out_float) {
  const int64_t M = x.size(0), K = x.size(1), S = K / kSuper, T = qs.size(0);
  const int f = static_cast<int>(fmt);
  const Path path = path_for(kiln::resolve_isa(isa, "kiln qlinear_kquant"));
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({M, n}, x.options().dtype(out_float || !bf16 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;

  thread_local std::vector<float> xf, xsum;
  xf.resize(static_cast<size_t>(M * K));
  xsum.resize(static_cast<size_t>(M * S * 8));
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xf.data() + m * K;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K;
      for (int64_t i = 0; i < K; ++i) dst[i] = kiln::bf16_bits_to_float(src[i]);
    } else {
      std::memcpy(dst, x.data_ptr<float>() + m * K, sizeof(float) * K);
    }
    for (int64_t g = 0; g < S * 8; ++g) {
      float s = 0.0f;
      for (int i = 0; i < kGroup; ++i) s += dst[g * kGroup + i];
      xsum[m * S * 8 + g] = s;
    }
  }
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln qlinear_kquant: bias must have n elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  const Problem p{fmt, M, n, S, qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), xf.data(), xsum.data(),
                  bias_pad.empty() ? nullptr : bias_pad.data(), y.data_ptr(), y.scalar_type() == torch::kBFloat16};
  const int64_t per_chunk = kquant_call_chunk_tiles(T, S * (super_bytes(f) + scale_bytes(f)), M, kMaxMB);
  const int64_t chunks = (T + per_chunk - 1) / per_chunk;
  kiln::parallel_tasks(chunks, [&](int64_t c) {
    const int64_t t0 = c * per_chunk, t1 = std::min(T, t0 + per_chunk);
#ifdef KILN_KQ_X86
    if (path != SCALAR && M > kMaxMB) {
      const bool wide = path == AVX512;
      if (f == Q4K) return run_panel_x86<Q4K>(p, t0, t1, wide);
      if (f == Q5K) return run_panel_x86<Q5K>(p, t0, t1, wide);
      return run_panel_x86<Q6K>(p, t0, t1, wide);
    }
    if (path != SCALAR) {
      const bool wide = path == AVX512;
      if (f == Q4K) return run_x86<Q4K>(p, t0, t1, wide);
      if (f == Q5K) return run_x86<Q5K>(p, t0, t1, wide);
      return run_x86<Q6K>(p, t0, t1, wide);
    }
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) tile_scalar(p, t, m0, std::min<int64_t>(kMaxMB, M - m0));
  });
  return y;
}

void check_problem(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt,
                   int64_t n) {
  TORCH_CHECK_VALUE(fmt >= Q4K && fmt <= Q6K, "kiln qlinear_kquant: unknown weight format ", fmt);
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE(K % kSuper == 0, "kiln qlinear_kquant: K = ", K, " is not whole superblocks of 256");
  const int64_t S = K / kSuper;
  const int f = static_cast<int>(fmt);
  TORCH_CHECK_VALUE(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 3 && qs.size(1) == S &&
                        qs.size(2) == super_bytes(f),
                    "kiln qlinear_kquant: packed weights do not match x (K = ", K, ")");
  const int64_t T = qs.size(0);
  TORCH_CHECK_VALUE(scales.scalar_type() == torch::kUInt8 && scales.is_contiguous() &&
                        scales.numel() == T * S * scale_bytes(f),
                    "kiln qlinear_kquant: scales do not match the packed weights");
  TORCH_CHECK_VALUE(n > (T - 1) * kRows && n <= T * kRows, "kiln qlinear_kquant: out_features ", n,
                    " does not match ", T, " tiles");
}

}  // namespace

namespace kiln {

torch::Tensor qlinear_kquant(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt,
                             int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                             bool out_float, bool float_act) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "kiln qlinear_kquant: x has ", x.dim() ? x.size(-1) : 0,
                    " features, the weight expects ", k);
  TORCH_CHECK_VALUE(x.device().is_cpu() && at::isFloatingType(x.scalar_type()),
                    "kiln qlinear_kquant: x must be a floating point CPU tensor");
  const auto dtype = x.scalar_type();
  const bool native = dtype == torch::kFloat32 || dtype == torch::kBFloat16;
  auto x2 = (native ? x : x.to(torch::kFloat32)).reshape({-1, k}).contiguous();
  check_problem(x2, qs, scales, fmt, n);
  auto y = float_act ? qlinear_kquant_2d(x2, qs, scales, fmt, n, bias, isa, out_float)
                     : qlinear_kquant_q8_2d(x2, qs, scales, fmt, n, bias, isa, out_float);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  y = y.view(sizes);
  return native || out_float ? y : y.to(dtype);
}

}  // namespace kiln
