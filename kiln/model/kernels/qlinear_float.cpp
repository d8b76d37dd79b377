// Quantized weights, float activations: y = x @ W^T for the tiled q4_1 / q8_0 weights of qlinear.cpp,
// with x kept in float32 (bfloat16 x is widened, which is exact). llama.cpp and `qlinear` quantize the
// activations to int8 per group of 32 for integer dot products; that is faster but moves near-tied
// greedy tokens of a small model. This kernel reads the same 4/8-bit weights (a third of bfloat16's
// bytes, so decode streams less memory than the dense path) and multiplies them with the activations
// as they are: the result is the dequantized weight's product up to float32 rounding.
//
// Every output is one fixed sequence of float32 operations, whatever M, the row block, the thread or
// the ISA (vector lanes are output rows, never K), so the three code paths compute the same bits and a
// row's result never depends on the batch it shares. Per output row n and activation row x, per group
// g of 32 K values in order:
//   lo = fma(q[4c+i], x[4c+i], lo), hi = fma(q[16+4c+i], x[16+4c+i], hi)   for c = 0..3, i = 0..3
//   acc = fma(d[n, g], lo + hi, acc);   q4_1 also: acc = fma(m[n, g], X[g], acc)
// with q the integer code (q4_1: 0..15; q8_0: -128..127) and X[g] the group's activations summed in
// K order. The bias is added last.

#include "qlinear_float.h"

#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_QF_X86 1
#include <immintrin.h>
#endif

namespace {

using kiln::half_bits_to_float;

constexpr int64_t Q4_1 = 0;
constexpr int kRows = 16;
constexpr int kGroup = 32;
constexpr int kMaxMB = 4;
// How far ahead of the group in use the one- and few-row passes (row_tile_avx2, tiles_avx2, tiles_avx512)
// prefetch the weights' codes and scales. Without it they ran at half their in-cache rate on weights
// streamed from memory: each 4 KB page restarts the hardware prefetcher, and these passes spend too
// long per byte for the misses to overlap. Measured on a 2-core Intel Xeon (2 threads, 200 distinct
// 1536x576 q4_1 weights, us a weight): AVX2 one row 70.6 -> 30-38, 2 rows 65 -> 53, 3 rows 92 -> 56-61,
// 4 rows 93 -> 69-75, AVX-512 one row 48 -> 36; the embedded model's AVX2 one-row step 9.4-13 ->
// 5.4-5.6 ms (p50), 2 KB ahead 5.6, 8 KB 5.8. The AVX2 many-row pass (run_groups_avx2) prefetches
// too (8 rows 129 -> 118 us, its in-cache rate); the AVX-512 one (run_panel_x86) gained nothing.
constexpr int64_t kPrefetchBytes = 4096;

inline int64_t qs_group_bytes(int64_t kind) { return kind == Q4_1 ? 256 : 512; }
inline int64_t scale_group_halfs(int64_t kind) { return kind == Q4_1 ? 32 : 16; }

struct Problem {
  int64_t kind, M, N, G;
  const uint8_t* qs;        // [T, G, qs_group_bytes]
  const uint16_t* scales;   // [T, G, scale_group_halfs] fp16 bits (q4_1: 16 d, then 16 m)
  const float* x;           // [M, G * 32] float32, zero past K
  const float* xsum;        // [M, G] each group's activations summed in K order
  const float* bias;        // [T * 16] or nullptr
  void* out;                // [M, N]
  bool out_bf16;
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  const int64_t n0 = t * kRows, cnt = std::min<int64_t>(kRows, p.N - n0);
  for (int64_t r = 0; r < cnt; ++r) {
    const float v = acc[r] + (p.bias ? p.bias[n0 + r] : 0.0f);
    if (p.out_bf16) {
      static_cast<uint16_t*>(p.out)[m * p.N + n0 + r] = kiln::float_to_bf16_bits(v);
    } else {
      static_cast<float*>(p.out)[m * p.N + n0 + r] = v;
    }
  }
}

// The integer code of row r, K index 4c+i (low) or 16+4c+i (high) in a group's bytes.
inline float code_scalar(int64_t kind, const uint8_t* qg, int c, int r, int i, bool high) {
  if (kind == Q4_1) {
    const uint8_t b = qg[c * 64 + r * 4 + i];
    return static_cast<float>(high ? b >> 4 : b & 0x0F);
  }
  return static_cast<float>(static_cast<int32_t>(qg[(high ? c + 4 : c) * 64 + r * 4 + i]) - 128);
}

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  const int64_t QB = qs_group_bytes(p.kind), SB = scale_group_halfs(p.kind), Kp = p.G * kGroup;
  for (int64_t j = 0; j < mb; ++j) {
    const float* x = p.x + (m0 + j) * Kp;
    float acc[kRows] = {};
    for (int64_t g = 0; g < p.G; ++g) {
      const uint8_t* qg = p.qs + (t * p.G + g) * QB;
      const uint16_t* sg = p.scales + (t * p.G + g) * SB;
      const float* xg = x + g * kGroup;
      for (int r = 0; r < kRows; ++r) {
        float lo = 0.0f, hi = 0.0f;
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            lo = std::fma(code_scalar(p.kind, qg, c, r, i, false), xg[4 * c + i], lo);
            hi = std::fma(code_scalar(p.kind, qg, c, r, i, true), xg[16 + 4 * c + i], hi);
          }
        acc[r] = std::fma(half_bits_to_float(sg[r]), lo + hi, acc[r]);
        if (p.kind == Q4_1) acc[r] = std::fma(half_bits_to_float(sg[16 + r]), p.xsum[(m0 + j) * p.G + g], acc[r]);
      }
    }
    store(p, m0 + j, t, acc);
  }
}

#ifdef KILN_QF_X86
#define KILN_QF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KILN_QF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

// The codes and scales of the group kPrefetchBytes of codes ahead of tile t's group g (kiln::group_ahead).
template <bool Q4>
inline void prefetch_ahead(const Problem& p, int64_t t, int64_t g, int nt = 1) {
  constexpr int64_t QB = Q4 ? 256 : 512, SB = Q4 ? 32 : 16;
  const int64_t at = kiln::group_ahead(t, g, p.G, kPrefetchBytes / QB, nt);
  for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p.qs + at * QB + b), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p.scales + at * SB), _MM_HINT_T0);
}

// NT consecutive tiles' rows 8h..8h+7 (h = 0, 1) for MB activation rows: lanes are output rows.
template <bool Q4, int NT, int MB>
KILN_QF_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0, int h, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = Q4 ? 256 : 512, SB = Q4 ? 32 : 16;
  const int64_t Kp = p.G * kGroup;
  const __m256i nib = _mm256_set1_epi32(0x0F), flip = _mm256_set1_epi32(static_cast<int>(0x80808080u));
  __m256 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    if (h == 0)
      for (int a = 0; a < NT; ++a) prefetch_ahead<Q4>(p, t + a, g, NT);
    __m256 lo[NT][MB], hi[NT][MB];
    for (int a = 0; a < NT; ++a)
      for (int j = 0; j < MB; ++j) lo[a][j] = hi[a][j] = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m256i vl[NT], vh[NT];
      for (int a = 0; a < NT; ++a) {
        const uint8_t* qg = p.qs + ((t + a) * p.G + g) * QB + 32 * h;
        vl[a] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64));
        // q8_0 bytes are code + 128: flipping the top bit makes them the signed code
        if (!Q4) {
          vl[a] = _mm256_xor_si256(vl[a], flip);
          vh[a] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (c + 4) * 64)), flip);
        }
      }
      for (int i = 0; i < 4; ++i) {
        for (int a = 0; a < NT; ++a) {
          __m256 wl, wh;
          if (Q4) {
            wl = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(vl[a], 8 * i), nib));
            wh = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(vl[a], 8 * i + 4), nib));
          } else {
            wl = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(vl[a], 24 - 8 * i), 24));
            wh = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(vh[a], 24 - 8 * i), 24));
          }
          for (int j = 0; j < MB; ++j) {
            const float* xg = p.x + (m0 + j) * Kp + g * kGroup;
            lo[a][j] = _mm256_fmadd_ps(wl, _mm256_broadcast_ss(xg + 4 * c + i), lo[a][j]);
            hi[a][j] = _mm256_fmadd_ps(wh, _mm256_broadcast_ss(xg + 16 + 4 * c + i), hi[a][j]);
          }
        }
      }
    }
    for (int a = 0; a < NT; ++a) {
      const uint16_t* sg = p.scales + ((t + a) * p.G + g) * SB + 8 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
      for (int j = 0; j < MB; ++j) {
        acc[a][j] = _mm256_fmadd_ps(d, _mm256_add_ps(lo[a][j], hi[a][j]), acc[a][j]);
        if (Q4) {
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16)));
          acc[a][j] = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.xsum[(m0 + j) * p.G + g]), acc[a][j]);
        }
      }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm256_storeu_ps(out[a][j] + 8 * h, acc[a][j]);
}

// A half tile's codes at c (8 rows' dwords; the code of row r, K index 4c+i in byte i), prepared once for
// its four K indices: q4_1 the low and high nibbles apart; q8_0 the bytes at c and c+4 with the top bit
// flipped (code + 128 becomes the signed code).
template <bool Q4>
KILN_QF_AVX2 inline void prepare_codes_avx2(const uint8_t* qg, int c, int h, __m256i& vl, __m256i& vh) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32 * h));
  if (Q4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    vl = _mm256_and_si256(v, low4);
    vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    vl = _mm256_xor_si256(v, flip);
    vh = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (c + 4) * 64 + 32 * h)), flip);
  }
}

// The float codes of K index 4c+i (wl) and 16+4c+i (wh) of the 8 rows: for q4_1 one vpshufb moves byte i
// of every row's dword to its bottom, zero-extended; for q8_0 one moves it to the top and an arithmetic
// shift brings it down sign-extended (one operation fewer on Intel's FMA ports than a shift pair: the
// 49152-row q8_0 head, one thread, 1.81-1.97 -> 1.67-1.81 ms on a 2-core Intel Xeon).
template <bool Q4>
KILN_QF_AVX2 inline void codes_at_avx2(__m256i vl, __m256i vh, int i, __m256& wl, __m256& wh) {
  if (Q4) {
    const __m256i pick = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(0x80808000u) | i),
                                          _mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12));
    wl = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(vl, pick));
    wh = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(vh, pick));
  } else {
    const __m256i top = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(0x00808080u) | (i << 24)),
                                         _mm256_setr_epi32(0, 0x04000000, 0x08000000, 0x0C000000, 0, 0x04000000,
                                                           0x08000000, 0x0C000000));
    wl = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(vl, top), 24));
    wh = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(vh, top), 24));
  }
}

// Group g's float pass for half h of activation row m: acc = fma(d, lo + hi, acc), then q4_1's
// acc = fma(m, X[g], acc), on the 8 sums at acc8.
template <bool Q4>
KILN_QF_AVX2 inline void finish_group_avx2(const Problem& p, int64_t t, int64_t g, int64_t m, int h, __m256 lo,
                                           __m256 hi, float* acc8) {
  const uint16_t* sg = p.scales + (t * p.G + g) * (Q4 ? 32 : 16);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8 * h)));
  __m256 s = _mm256_fmadd_ps(d, _mm256_add_ps(lo, hi), _mm256_loadu_ps(acc8));
  if (Q4) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16 + 8 * h)));
    s = _mm256_fmadd_ps(mv, _mm256_set1_ps(p.xsum[m * p.G + g]), s);
  }
  _mm256_storeu_ps(acc8, s);
}

// One activation row (a decode step): both halves of a tile per pass, so each activation broadcast
// feeds 16 output rows, and the group's running sums live in `acc` (memory: they change once per 32 K
// values), leaving the registers to the four chains (lo and hi of each half) and the codes. tiles_avx2
// shifts and masks per K index instead (an operation more per 8 weights) and keeps every tile's codes
// and sums in registers, which spills at one row and four tiles side by side.
template <bool Q4>
KILN_QF_AVX2 void row_tile_avx2(const Problem& p, int64_t t, int64_t m, float* out) {
  constexpr int64_t QB = Q4 ? 256 : 512;
  const float* x = p.x + m * p.G * kGroup;
  alignas(32) float acc[kRows] = {};
  for (int64_t g = 0; g < p.G; ++g) {
    const float* xg = x + g * kGroup;
    const uint8_t* qg = p.qs + (t * p.G + g) * QB;
    prefetch_ahead<Q4>(p, t, g);
    __m256 lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, hi[2] = {lo[0], lo[1]};
    for (int c = 0; c < 4; ++c) {
      __m256i vl[2], vh[2];
      for (int h = 0; h < 2; ++h) prepare_codes_avx2<Q4>(qg, c, h, vl[h], vh[h]);
      for (int i = 0; i < 4; ++i) {
        const __m256 xl = _mm256_broadcast_ss(xg + 4 * c + i), xh = _mm256_broadcast_ss(xg + 16 + 4 * c + i);
        for (int h = 0; h < 2; ++h) {
          __m256 wl, wh;
          codes_at_avx2<Q4>(vl[h], vh[h], i, wl, wh);
          lo[h] = _mm256_fmadd_ps(wl, xl, lo[h]);
          hi[h] = _mm256_fmadd_ps(wh, xh, hi[h]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) finish_group_avx2<Q4>(p, t, g, m, h, lo[h], hi[h], acc + 8 * h);
  }
  std::memcpy(out, acc, sizeof(acc));
}

template <bool Q4, int NT, int MB>
KILN_QF_AVX512 void tiles_avx512(const Problem& p, int64_t t, int64_t m0, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = Q4 ? 256 : 512, SB = Q4 ? 32 : 16;
  const int64_t Kp = p.G * kGroup;
  const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));
  // float(q) for q = 0..15: exactly what converting the masked nibble gives, so the same bits
  const __m512 nib_float = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // each 128-bit lane's dword k starts at byte 4k (vpshufb indexes within a lane)
  const __m512i byte_rows = _mm512_set4_epi32(0x0C000000, 0x08000000, 0x04000000, 0);
  __m512 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    for (int a = 0; a < NT; ++a) prefetch_ahead<Q4>(p, t + a, g, NT);
    __m512 lo[NT][MB], hi[NT][MB];
    for (int a = 0; a < NT; ++a)
      for (int j = 0; j < MB; ++j) lo[a][j] = hi[a][j] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m512i vl[NT], vh[NT];
      for (int a = 0; a < NT; ++a) {
        const uint8_t* qg = p.qs + ((t + a) * p.G + g) * QB;
        vl[a] = _mm512_loadu_si512(qg + c * 64);
        if (!Q4) {
          vl[a] = _mm512_xor_si512(vl[a], flip);
          vh[a] = _mm512_xor_si512(_mm512_loadu_si512(qg + (c + 4) * 64), flip);
        }
      }
      for (int i = 0; i < 4; ++i) {
        for (int a = 0; a < NT; ++a) {
          __m512 wl, wh;
          if (Q4) {
            // vpermps reads the low 4 bits of each index: the nibble's float from a table, one
            // operation (on the shuffle port) where masking and converting took two on the FMA ports
            wl = _mm512_permutexvar_ps(i == 0 ? vl[a] : _mm512_srli_epi32(vl[a], 8 * i), nib_float);
            wh = _mm512_permutexvar_ps(_mm512_srli_epi32(vl[a], 8 * i + 4), nib_float);
          } else {
            // byte i of each dword to its top by vpshufb, then one arithmetic shift (codes_at_avx2's
            // way: a shuffle-port operation in place of a shift on the FMA ports)
            const __m512i top = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(0x00808080u) | (i << 24)), byte_rows);
            wl = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_shuffle_epi8(vl[a], top), 24));
            wh = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_shuffle_epi8(vh[a], top), 24));
          }
          for (int j = 0; j < MB; ++j) {
            const float* xg = p.x + (m0 + j) * Kp + g * kGroup;
            lo[a][j] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xg[4 * c + i]), lo[a][j]);
            hi[a][j] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xg[16 + 4 * c + i]), hi[a][j]);
          }
        }
      }
    }
    for (int a = 0; a < NT; ++a) {
      const uint16_t* sg = p.scales + ((t + a) * p.G + g) * SB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
      for (int j = 0; j < MB; ++j) {
        acc[a][j] = _mm512_fmadd_ps(d, _mm512_add_ps(lo[a][j], hi[a][j]), acc[a][j]);
        if (Q4) {
          const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + 16)));
          acc[a][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.xsum[(m0 + j) * p.G + g]), acc[a][j]);
        }
      }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out[a][j], acc[a][j]);
}

// Many activation rows (prefill): a tile's codes are converted to float32 once, into a panel in the
// order the chains read them ([g][c][i][low, high][16 rows]), and every block of rows runs the same
// chains from the panel: the same operations on the same values, so the same bits as unpacking per row
// block, without paying the conversion M / 4 times. The panel's slice for group g (512 floats):
template <bool Q4>
KILN_QF_AVX2 void unpack_group_avx2(const Problem& p, int64_t t, int64_t g, float* dst) {
  const uint8_t* qg = p.qs + (t * p.G + g) * (Q4 ? 256 : 512);
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {
      __m256i vl, vh;
      prepare_codes_avx2<Q4>(qg, c, h, vl, vh);
      for (int i = 0; i < 4; ++i) {
        float* o = dst + ((c * 4 + i) * 2) * kRows + 8 * h;
        __m256 wl, wh;
        codes_at_avx2<Q4>(vl, vh, i, wl, wh);
        _mm256_storeu_ps(o, wl);
        _mm256_storeu_ps(o + kRows, wh);
      }
    }
}

template <bool Q4>
KILN_QF_AVX2 void unpack_avx2(const Problem& p, int64_t t, float* panel) {
  for (int64_t g = 0; g < p.G; ++g) unpack_group_avx2<Q4>(p, t, g, panel + g * kGroup * kRows);
}

// Group g's chains for activation rows m0..m0+MB-1 (MB <= 3) over all 16 output rows, from its slice
// in L1, into their running sums acc[j][16] (tile_scalar's operations for one group).
template <bool Q4, int MB>
KILN_QF_AVX2 void group_rows_avx2(const Problem& p, int64_t t, int64_t g, int64_t m0, const float* slice, float* acc) {
  const int64_t Kp = p.G * kGroup;
  __m256 lo[MB][2], hi[MB][2];
  for (int j = 0; j < MB; ++j) lo[j][0] = lo[j][1] = hi[j][0] = hi[j][1] = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 4; ++i) {
      const float* src = slice + ((c * 4 + i) * 2) * kRows;
      const __m256 wl0 = _mm256_load_ps(src), wl1 = _mm256_load_ps(src + 8);
      const __m256 wh0 = _mm256_load_ps(src + kRows), wh1 = _mm256_load_ps(src + kRows + 8);
      for (int j = 0; j < MB; ++j) {
        const float* xg = p.x + (m0 + j) * Kp + g * kGroup;
        const __m256 xl = _mm256_broadcast_ss(xg + 4 * c + i), xh = _mm256_broadcast_ss(xg + 16 + 4 * c + i);
        lo[j][0] = _mm256_fmadd_ps(wl0, xl, lo[j][0]);
        lo[j][1] = _mm256_fmadd_ps(wl1, xl, lo[j][1]);
        hi[j][0] = _mm256_fmadd_ps(wh0, xh, hi[j][0]);
        hi[j][1] = _mm256_fmadd_ps(wh1, xh, hi[j][1]);
      }
    }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < MB; ++j) finish_group_avx2<Q4>(p, t, g, m0 + j, h, lo[j][h], hi[j][h], acc + j * kRows + 8 * h);
}

template <bool Q4, int MB>
KILN_QF_AVX512 void panel_avx512(const Problem& p, int64_t t, int64_t m0, const float* panel, float (*out)[kRows]) {
  constexpr int64_t SB = Q4 ? 32 : 16;
  const int64_t Kp = p.G * kGroup;
  __m512 acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    __m512 lo[MB], hi[MB];
    for (int j = 0; j < MB; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 4; ++i) {
        const float* src = panel + (((g * 4 + c) * 4 + i) * 2) * kRows;
        const __m512 wl = _mm512_loadu_ps(src), wh = _mm512_loadu_ps(src + kRows);
        for (int j = 0; j < MB; ++j) {
          const float* xg = p.x + (m0 + j) * Kp + g * kGroup;
          lo[j] = _mm512_fmadd_ps(wl, _mm512_set1_ps(xg[4 * c + i]), lo[j]);
          hi[j] = _mm512_fmadd_ps(wh, _mm512_set1_ps(xg[16 + 4 * c + i]), hi[j]);
        }
      }
    const uint16_t* sg = p.scales + (t * p.G + g) * SB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
    for (int j = 0; j < MB; ++j) {
      acc[j] = _mm512_fmadd_ps(d, _mm512_add_ps(lo[j], hi[j]), acc[j]);
      if (Q4) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + 16)));
        acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.xsum[(m0 + j) * p.G + g]), acc[j]);
      }
    }
  }
  for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out[j], acc[j]);
}

// Group g of two tiles side by side for activation rows m0..m0+MB-1, from the group's unpacked slices
// (in L1), into the rows' running sums acc[j][tile][16]: each activation broadcast feeds both tiles'
// chains. The whole-tile panels of panel_avx512 (36 KB a tile at K = 576) stream from L2 once per 4
// rows, and a broadcast per FMA besides: held to the loads' rate, not the FMAs'. Every output gets
// panel_avx512's operations in its order, so the same bits.
template <bool Q4, int MB>
KILN_QF_AVX512 void group2_avx512(const Problem& p, int64_t t, int64_t g, int64_t m0, const float* const* slices,
                                  float* acc) {
  constexpr int64_t SB = Q4 ? 32 : 16;
  const int64_t Kp = p.G * kGroup;
  __m512 lo[2][MB], hi[2][MB];
  for (int a = 0; a < 2; ++a)
    for (int j = 0; j < MB; ++j) lo[a][j] = hi[a][j] = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 4; ++i) {
      const int64_t at = ((c * 4 + i) * 2) * kRows;
      const __m512 wl0 = _mm512_load_ps(slices[0] + at), wh0 = _mm512_load_ps(slices[0] + at + kRows);
      const __m512 wl1 = _mm512_load_ps(slices[1] + at), wh1 = _mm512_load_ps(slices[1] + at + kRows);
      for (int j = 0; j < MB; ++j) {
        const float* xg = p.x + (m0 + j) * Kp + g * kGroup;
        const __m512 xl = _mm512_set1_ps(xg[4 * c + i]), xh = _mm512_set1_ps(xg[16 + 4 * c + i]);
        lo[0][j] = _mm512_fmadd_ps(wl0, xl, lo[0][j]);
        lo[1][j] = _mm512_fmadd_ps(wl1, xl, lo[1][j]);
        hi[0][j] = _mm512_fmadd_ps(wh0, xh, hi[0][j]);
        hi[1][j] = _mm512_fmadd_ps(wh1, xh, hi[1][j]);
      }
    }
  for (int a = 0; a < 2; ++a) {
    const uint16_t* sg = p.scales + ((t + a) * p.G + g) * SB;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
    for (int j = 0; j < MB; ++j) {
      float* aj = acc + (j * 2 + a) * kRows;
      __m512 v = _mm512_fmadd_ps(d, _mm512_add_ps(lo[a][j], hi[a][j]), _mm512_loadu_ps(aj));
      if (Q4) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + 16)));
        v = _mm512_fmadd_ps(mv, _mm512_set1_ps(p.xsum[(m0 + j) * p.G + g]), v);
      }
      _mm512_storeu_ps(aj, v);
    }
  }
}

// Rows [0, M) of tiles t and t + 1: group by group, every row block through the group's slices while
// they sit in L1 (as run_groups_avx2 does), the running sums in a buffer (touched once per group).
template <bool Q4>
KILN_QF_AVX512 void run_pair_avx512(const Problem& p, int64_t t) {
  thread_local std::vector<float> acc_buf;
  acc_buf.assign(static_cast<size_t>(p.M * 2 * kRows), 0.0f);
  float* acc = acc_buf.data();
  alignas(64) float slice[2][kGroup * kRows];
  const float* slices[2] = {slice[0], slice[1]};
  for (int64_t g = 0; g < p.G; ++g) {
    for (int a = 0; a < 2; ++a) {
      prefetch_ahead<Q4>(p, t + a, g);
      unpack_group_avx2<Q4>(p, t + a, g, slice[a]);
    }
    int64_t m0 = 0;
    for (; m0 + kMaxMB <= p.M; m0 += kMaxMB) group2_avx512<Q4, kMaxMB>(p, t, g, m0, slices, acc + m0 * 2 * kRows);
    switch (p.M - m0) {
      case 1: group2_avx512<Q4, 1>(p, t, g, m0, slices, acc + m0 * 2 * kRows); break;
      case 2: group2_avx512<Q4, 2>(p, t, g, m0, slices, acc + m0 * 2 * kRows); break;
      case 3: group2_avx512<Q4, 3>(p, t, g, m0, slices, acc + m0 * 2 * kRows); break;
      default: break;
    }
  }
  for (int64_t m = 0; m < p.M; ++m)
    for (int a = 0; a < 2; ++a) store(p, m, t + a, acc + (m * 2 + a) * kRows);
}

// AVX2, rows [0, M) of tiles [t0, t1) (M above one row block): group by group, every row block through
// one group's slice while it sits in L1, the rows' running sums in `acc`. A whole tile's panel (36 KB
// at K = 576) outgrew L1, and streaming it from L2 once per pair of rows held these FMAs at half their
// rate; three rows at a time give 12 independent chains, enough to cover the FMA latency.
template <bool Q4>
void run_groups_avx2(const Problem& p, int64_t t0, int64_t t1) {
  thread_local std::vector<float> acc_buf;
  acc_buf.resize(static_cast<size_t>(p.M * kRows));
  float* acc = acc_buf.data();
  alignas(32) float slice[kGroup * kRows];
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc, acc + p.M * kRows, 0.0f);
    for (int64_t g = 0; g < p.G; ++g) {
      prefetch_ahead<Q4>(p, t, g);
      unpack_group_avx2<Q4>(p, t, g, slice);
      int64_t m0 = 0;
      for (; m0 + 3 <= p.M; m0 += 3) group_rows_avx2<Q4, 3>(p, t, g, m0, slice, acc + m0 * kRows);
      if (p.M - m0 == 2) group_rows_avx2<Q4, 2>(p, t, g, m0, slice, acc + m0 * kRows);
      if (p.M - m0 == 1) group_rows_avx2<Q4, 1>(p, t, g, m0, slice, acc + m0 * kRows);
    }
    for (int64_t m = 0; m < p.M; ++m) store(p, m, t, acc + m * kRows);
  }
}

// Rows [0, M) of tiles [t0, t1) through panels (M above one row block).
template <bool Q4>
void run_panel_x86(const Problem& p, int64_t t0, int64_t t1, bool avx512) {
  if (!avx512) return run_groups_avx2<Q4>(p, t0, t1);
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(p.G * kGroup * kRows));
  float out[kMaxMB][kRows];
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) run_pair_avx512<Q4>(p, t);   // tiles in pairs, an odd last one below
  for (; t < t1; ++t) {
    unpack_avx2<Q4>(p, t, panel.data());
    for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
      const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
      switch (mb) {
        case 1: panel_avx512<Q4, 1>(p, t, m0, panel.data(), out); break;
        case 2: panel_avx512<Q4, 2>(p, t, m0, panel.data(), out); break;
        case 3: panel_avx512<Q4, 3>(p, t, m0, panel.data(), out); break;
        default: panel_avx512<Q4, 4>(p, t, m0, panel.data(), out); break;
      }
      for (int j = 0; j < mb; ++j) store(p, m0 + j, t, out[j]);
    }
  }
}

// Few activation rows: several tiles side by side (independent chains hide the FMA latency; on AVX2
// one row takes row_tile_avx2 instead); more rows: one tile, up to 4 rows sharing each unpacked weight
// vector.
template <bool Q4>
void run_x86(const Problem& p, int64_t t0, int64_t t1, bool avx512) {
  float out[4][kMaxMB][kRows];
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
    const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
    const int nt = mb == 1 ? 4 : mb == 2 ? 2 : 1;
    for (int64_t t = t0; t < t1;) {
      const int n = static_cast<int>(std::min<int64_t>(nt, t1 - t));
#define KILN_QF_CALL(NT, MB)                                                      \
  if (avx512) {                                                                   \
    tiles_avx512<Q4, NT, MB>(p, t, m0, out);                                      \
  } else {                                                                        \
    tiles_avx2<Q4, NT, MB>(p, t, m0, 0, out);                                     \
    tiles_avx2<Q4, NT, MB>(p, t, m0, 1, out);                                     \
  }
      if (mb == 1 && !avx512) {
        row_tile_avx2<Q4>(p, t, m0, out[0][0]);
        store(p, m0, t, out[0][0]);
        ++t;
        continue;
      }
      if (n == 4 && mb == 1) {
        tiles_avx512<Q4, 4, 1>(p, t, m0, out);
      } else if (n == 2 && mb == 2) {
        KILN_QF_CALL(2, 2)
      } else {
        switch (mb) {
          case 1: tiles_avx512<Q4, 1, 1>(p, t, m0, out); break;
          case 2: KILN_QF_CALL(1, 2) break;
          case 3: KILN_QF_CALL(1, 3) break;
          default: KILN_QF_CALL(1, 4) break;
        }
      }
#undef KILN_QF_CALL
      const int done = (n == 4 && mb == 1) || (n == 2 && mb == 2) ? n : 1;
      for (int a = 0; a < done; ++a)
        for (int j = 0; j < mb; ++j) store(p, m0 + j, t + a, out[a][j]);
      t += done;
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

torch::Tensor qlinear_float_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                               int64_t kind, int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa,
                               bool out_float) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, "kiln qlinear_float: unknown weight kind ", kind);
  const int64_t M = x.size(0), K = x.size(1), G = (K + kGroup - 1) / kGroup, Kp = G * kGroup;
  TORCH_CHECK_VALUE(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 3 && qs.size(1) == G &&
                        qs.size(2) == qs_group_bytes(kind),
                    "kiln qlinear_float: packed weights do not match x (K = ", K, ")");
  const int64_t T = qs.size(0);
  TORCH_CHECK_VALUE(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                        scales.numel() == T * G * scale_group_halfs(kind),
                    "kiln qlinear_float: scales do not match the packed weights");
  TORCH_CHECK_VALUE(n > (T - 1) * kRows && n <= T * kRows, "kiln qlinear_float: out_features ", n,
                    " does not match ", T, " tiles");
  const Path path = path_for(kiln::resolve_isa(isa, "kiln qlinear_float"));
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({M, n}, x.options().dtype(out_float || !bf16 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;

  // float32 activations padded to whole groups, and each group's sum in K order (q4_1's m term)
  thread_local std::vector<float> xf, xsum;
  xf.assign(static_cast<size_t>(M * Kp), 0.0f);
  xsum.resize(static_cast<size_t>(M * G));
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xf.data() + m * Kp;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K;
      for (int64_t i = 0; i < K; ++i) dst[i] = kiln::bf16_bits_to_float(src[i]);
    } else {
      std::memcpy(dst, x.data_ptr<float>() + m * K, sizeof(float) * K);
    }
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int i = 0; i < kGroup; ++i) s += dst[g * kGroup + i];
      xsum[m * G + g] = s;
    }
  }
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln qlinear_float: bias must have n elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  const bool out_bf16 = y.scalar_type() == torch::kBFloat16;
  const Problem p{kind, M, n, G, qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                  xf.data(), xsum.data(), bias_pad.empty() ? nullptr : bias_pad.data(), y.data_ptr(), out_bf16};
  // chunks of consecutive tiles (a few KB of weights each, whole groups of 4 for the side-by-side decode)
  const int64_t tile_bytes = G * (qs_group_bytes(kind) + 2 * scale_group_halfs(kind));
  // chunks of 4 tiles (the side-by-side decode's group) for thin weights, fewer for wide ones: enough
  // chunks that the threads finish together (a 576-row projection is 36 tiles), small enough that a call
  // of several row blocks re-reads each from L2; a decode call's are long runs (stream_chunk_tiles)
  const int64_t small = std::max<int64_t>(4, std::min<int64_t>(((int64_t{32} << 10) / tile_bytes + 3) / 4 * 4,
                                                               (T / 16 + 3) / 4 * 4));
  const int64_t per_chunk = M <= kMaxMB ? kiln::stream_chunk_tiles(T, at::get_num_threads(), 4, small) : small;
  const int64_t chunks = (T + per_chunk - 1) / per_chunk;
  kiln::parallel_tasks(chunks, [&](int64_t c) {
    const int64_t t0 = c * per_chunk, t1 = std::min(T, t0 + per_chunk);
#ifdef KILN_QF_X86
    if (path != SCALAR && M > kMaxMB) {
      return kind == Q4_1 ? run_panel_x86<true>(p, t0, t1, path == AVX512)
                          : run_panel_x86<false>(p, t0, t1, path == AVX512);
    }
    if (path != SCALAR) {
      return kind == Q4_1 ? run_x86<true>(p, t0, t1, path == AVX512) : run_x86<false>(p, t0, t1, path == AVX512);
    }
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) tile_scalar(p, t, m0, std::min<int64_t>(kMaxMB, M - m0));
  });
  return y;
}

}  // namespace

namespace kiln {

torch::Tensor qlinear_float(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                            int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                            bool out_float) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "kiln qlinear_float: x has ", x.dim() ? x.size(-1) : 0,
                    " features, the weight expects ", k);
  TORCH_CHECK_VALUE(x.device().is_cpu() && at::isFloatingType(x.scalar_type()),
                    "kiln qlinear_float: x must be a floating point CPU tensor");
  const auto dtype = x.scalar_type();
  const bool native = dtype == torch::kFloat32 || dtype == torch::kBFloat16;
  auto x2 = (native ? x : x.to(torch::kFloat32)).reshape({-1, k}).contiguous();
  auto y = qlinear_float_2d(x2, qs, scales, kind, n, bias, isa, out_float);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  y = y.view(sizes);
  return native || out_float ? y : y.to(dtype);
}

}  // namespace kiln
