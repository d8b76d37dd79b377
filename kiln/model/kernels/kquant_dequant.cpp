// The K-quant tiles back into dense weights, for the torch paths: training and scoring over a model held
// only as blocks dequantize every projection where they use it, in forward and in backward, so this runs
// over the whole model twice a training step.
//
// Each value is computed in float32 as gguf.quants.dequantize computes it (Q4_K / Q5_K:
// q * (d * sc) - dmin * m, two roundings; Q6_K: (q - 32) * (d * sc)), then rounded to bfloat16 if asked.
// The scalar path is the reference; the AVX2 and AVX-512 paths run the same float32 operations in the
// same order (a product, then a sum with the exactly negated dmin * m; never a fused multiply-add), so
// every ISA gives the same bits. The SIMD paths turn a group's 16 (AVX-512) or 8 (AVX2) rows of codes,
// which the tile stores as 4-byte runs of each row side by side, into each row's 32 codes in K order
// with a 4x4 transpose of 32-bit words in registers, then widen, scale and store one row at a time.
//
// The transposed pass (kquant_dequantize_t) writes a range of K's columns as rows, W[:, k0:k1]^T: the
// backward's input gradient grad @ W multiplies at the forward's speed from that layout (oneDNN's
// bfloat16 matmul reads a transposed B ~20% faster than a row-major one), and a range of columns is a
// whole slice of the product's outputs, so a weight goes in panels with the whole product's bits. It
// needs no transpose: each 32-bit lane of a group's code vectors is one row, so shifting and masking
// gives 16 (AVX-512) or 8 (AVX2) rows' codes of one K index, which are scaled with the rows' factors in
// lanes and stored as one run of the output row. Same values, same operations as the row-major pass.

#include "kquant_pack.h"

#include <ATen/Parallel.h>

#include "bf16_simd.h"
#include "isa.h"
#include "kquant_tiles.h"
#include "qlinear.h"

#include <cstdint>
#include <cstring>

namespace {

using namespace kiln::kq;
using kiln::float_to_bf16_bits;
using kiln::half_bits_to_float;

struct Dense {
  const uint8_t* qs;   // [T, S, super_bytes]
  const uint8_t* sc;   // [T, S, scale_bytes]
  int64_t S, n, k;
  bool bf16;
  void* out;           // [n, k]
};

// ---------------------------------------------------------------- scalar reference

// Group j's affine map for row r of a tile: a weight is q * a - b, with a0 for its first 16 values and
// a1 for the rest (Q6_K's two 16-value sub-scales; the others share one scale and subtract a min).
template <int F>
inline void group_affine(const uint8_t* sb, int r, int j, float d, float dmin, float& a0, float& a1, float& b) {
  b = 0.0f;
  if (F == Q6K) {
    a0 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j) * 16 + r]));
    a1 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j + 1) * 16 + r]));
  } else {
    int sc, mn;
    scale_min_scalar(sb, r, j, sc, mn);
    a0 = a1 = d * static_cast<float>(sc);
    b = dmin * static_cast<float>(mn);
  }
}

template <int F>
void tile_scalar(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S;
  for (int r = 0; r < kRows && t * kRows + r < p.n; ++r) {
    const int64_t row = t * kRows + r;
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* sb = p.sc + (t * S + s) * SB;
      const float d = half_bits_to_float(load_u16(sb + 2 * r));
      const float dmin = F == Q6K ? 0.0f : half_bits_to_float(load_u16(sb + 32 + 2 * r));
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
        float a0, a1, b;
        group_affine<F>(sb, r, j, d, dmin, a0, a1, b);
        float w[kGroup];
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = qg[c * 64 + r * 4 + i];
            int lo = byte & 15, hi = byte >> 4;
            if (F == Q5K) {
              const int hb = qg[256 + r * 4 + i];
              lo |= ((hb >> c) & 1) << 4;
              hi |= ((hb >> (4 + c)) & 1) << 4;
            }
            if (F == Q6K) {
              lo |= ((qg[256 + r * 4 + i] >> (2 * c)) & 3) << 4;
              hi |= ((qg[320 + r * 4 + i] >> (2 * c)) & 3) << 4;
              w[4 * c + i] = static_cast<float>(lo - 32) * a0;
              w[16 + 4 * c + i] = static_cast<float>(hi - 32) * a1;
            } else {
              w[4 * c + i] = static_cast<float>(lo) * a0 - b;
              w[16 + 4 * c + i] = static_cast<float>(hi) * a1 - b;
            }
          }
        const int64_t at = row * p.k + s * kSuper + j * kGroup;
        if (p.bf16) {
          uint16_t* o = static_cast<uint16_t*>(p.out) + at;
          for (int i = 0; i < kGroup; ++i) o[i] = float_to_bf16_bits(w[i]);
        } else {
          std::memcpy(static_cast<float*>(p.out) + at, w, sizeof(w));
        }
      }
    }
  }
}

#ifdef KILN_KQ_X86

// ---------------------------------------------------------------- AVX-512: a group's 16 rows at once

// 4x4 transpose of 32-bit words within each 128-bit lane: in, word p of lane L of vector c is row 4L+p's
// 4 codes of run c; out, lane L of vector p holds row 4L+p's runs 0..3, its 16 codes in K order.
KILN_KQ_AVX512 inline void transpose_runs(const __m512i* a, uint8_t* buf) {
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpacklo_epi32(a[2], a[3]);
  const __m512i t2 = _mm512_unpackhi_epi32(a[0], a[1]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  _mm512_store_si512(buf, _mm512_unpacklo_epi64(t0, t1));
  _mm512_store_si512(buf + 64, _mm512_unpackhi_epi64(t0, t1));
  _mm512_store_si512(buf + 128, _mm512_unpacklo_epi64(t2, t3));
  _mm512_store_si512(buf + 192, _mm512_unpackhi_epi64(t2, t3));
}

// 16 codes (bytes; Q6_K signed) times a, plus b, stored as float32 or bfloat16
template <int F>
KILN_KQ_AVX512 inline void row16_avx512(const uint8_t* codes, float a, float b, bool bf16, void* dst) {
  const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512 v = _mm512_cvtepi32_ps(F == Q6K ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q));
  __m512 w = _mm512_mul_ps(v, _mm512_set1_ps(a));
  if (F != Q6K) w = _mm512_add_ps(w, _mm512_set1_ps(b));
  if (bf16) {
    _mm256_storeu_si256(static_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(kiln::bf16_bits16(w)));
  } else {
    _mm512_storeu_ps(static_cast<float*>(dst), w);
  }
}

template <int F>
KILN_KQ_AVX512 void tile_avx512(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S, rows = p.n - t * kRows < kRows ? p.n - t * kRows : kRows, es = p.bf16 ? 2 : 4;
  alignas(64) float f0[8][kRows], f1[8][kRows];
  alignas(64) uint8_t lo[256], hi[256];
  uint8_t* out = static_cast<uint8_t*>(p.out) + t * kRows * p.k * es;
  for (int64_t s = 0; s < S; ++s) {
    __m512 v0[8], v1[8];
    scales_avx512<F>(p.sc + (t * S + s) * SB, v0, v1);
    for (int j = 0; j < 8; ++j) {
      _mm512_store_ps(f0[j], v0[j]);
      _mm512_store_ps(f1[j], v1[j]);
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
      __m512i a[4], b[4];
      if (F == Q4K) {
        const __m512i m15 = _mm512_set1_epi8(15);
        for (int c = 0; c < 4; ++c) a[c] = _mm512_loadu_si512(qg + c * 64);
        alignas(64) uint8_t raw[256];
        transpose_runs(a, raw);
        for (int x = 0; x < 4; ++x) {
          const __m512i v = _mm512_load_si512(raw + 64 * x);
          _mm512_store_si512(lo + 64 * x, _mm512_and_si512(v, m15));
          _mm512_store_si512(hi + 64 * x, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
        }
      } else {
        for (int c = 0; c < 4; ++c) codes_avx512<F>(qg, c, a[c], b[c]);
        transpose_runs(a, lo);
        transpose_runs(b, hi);
      }
      const int64_t col = s * kSuper + j * kGroup;
      for (int r = 0; r < rows; ++r) {
        const int at = (r & 3) * 64 + (r >> 2) * 16;
        uint8_t* o = out + (r * p.k + col) * es;
        if (F == Q6K) {
          row16_avx512<F>(lo + at, f0[j][r], 0.0f, p.bf16, o);
          row16_avx512<F>(hi + at, f1[j][r], 0.0f, p.bf16, o + 16 * es);
        } else {
          row16_avx512<F>(lo + at, f0[j][r], f1[j][r], p.bf16, o);
          row16_avx512<F>(hi + at, f0[j][r], f1[j][r], p.bf16, o + 16 * es);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- AVX2: a group's rows 8 at a time

KILN_KQ_AVX2 inline void transpose_runs(const __m256i* a, uint8_t* buf) {
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpacklo_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_unpackhi_epi32(a[0], a[1]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), _mm256_unpacklo_epi64(t0, t1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32), _mm256_unpackhi_epi64(t0, t1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 64), _mm256_unpacklo_epi64(t2, t3));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 96), _mm256_unpackhi_epi64(t2, t3));
}

template <int F>
KILN_KQ_AVX2 inline void row8_avx2(const uint8_t* codes, float a, float b, bool bf16, void* dst) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m256 v = _mm256_cvtepi32_ps(F == Q6K ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
  __m256 w = _mm256_mul_ps(v, _mm256_set1_ps(a));
  if (F != Q6K) w = _mm256_add_ps(w, _mm256_set1_ps(b));
  if (bf16) {
    kiln::store_bf16_bits8(dst, kiln::bf16_bits8(w));
  } else {
    _mm256_storeu_ps(static_cast<float*>(dst), w);
  }
}

template <int F>
KILN_KQ_AVX2 void tile_avx2(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S, rows = p.n - t * kRows < kRows ? p.n - t * kRows : kRows, es = p.bf16 ? 2 : 4;
  alignas(32) float f0[8][kRows], f1[8][kRows];
  alignas(32) uint8_t lo[128], hi[128];
  uint8_t* out = static_cast<uint8_t*>(p.out) + t * kRows * p.k * es;
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = p.sc + (t * S + s) * SB;
    for (int h = 0; h < 2; ++h) {
      __m256 v0[8], v1[8];
      scales_avx2<F>(sb, h, v0, v1);
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_ps(f0[j] + 8 * h, v0[j]);
        _mm256_storeu_ps(f1[j] + 8 * h, v1[j]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
      const int64_t col = s * kSuper + j * kGroup;
      for (int h = 0; h < 2 && 8 * h < rows; ++h) {
        __m256i a[4], b[4];
        for (int c = 0; c < 4; ++c) codes_avx2<F>(qg, c, h, a[c], b[c]);
        transpose_runs(a, lo);
        transpose_runs(b, hi);
        for (int r = 8 * h; r < rows && r < 8 * h + 8; ++r) {
          const int at = (r & 3) * 32 + ((r >> 2) & 1) * 16;
          const float ca = f0[j][r], cb = F == Q6K ? f1[j][r] : f0[j][r], m = F == Q6K ? 0.0f : f1[j][r];
          uint8_t* o = out + (r * p.k + col) * es;
          row8_avx2<F>(lo + at, ca, m, p.bf16, o);
          row8_avx2<F>(lo + at + 8, ca, m, p.bf16, o + 8 * es);
          row8_avx2<F>(hi + at, cb, m, p.bf16, o + 16 * es);
          row8_avx2<F>(hi + at + 8, cb, m, p.bf16, o + 24 * es);
        }
      }
    }
  }
}
#endif

// ---------------------------------------------------------------- transposed: W[:, k0:k1]^T

struct DenseT {
  const uint8_t* qs;   // [T, S, super_bytes]
  const uint8_t* sc;   // [T, S, scale_bytes]
  int64_t S, n, s0, s1;
  bool bf16;
  void* out;           // [(s1 - s0) * 256, n]
};

// Tiles of one task: the task writes each of its K indices' output rows in runs of kBlockTiles * 16
// values (a few KB; each store of a tile lands next to the previous tile's), where a tile at a time would
// scatter 32-byte pieces over 256 rows a superblock, a page apart. Even, so a bfloat16 run ends on a
// 64-byte line and no two threads write one line.
constexpr int64_t kBlockTiles = 32;

template <int F>
void tile_t_scalar(const DenseT& p, int64_t t, int64_t s) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  for (int r = 0; r < kRows && t * kRows + r < p.n; ++r) {
    const int64_t row = t * kRows + r;
    const uint8_t* sb = p.sc + (t * p.S + s) * SB;
    const float d = half_bits_to_float(load_u16(sb + 2 * r));
    const float dmin = F == Q6K ? 0.0f : half_bits_to_float(load_u16(sb + 32 + 2 * r));
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qg = p.qs + (t * p.S + s) * QS + j * QB;
      float a0, a1, b;
      group_affine<F>(sb, r, j, d, dmin, a0, a1, b);
      const int64_t k = (s - p.s0) * kSuper + j * kGroup;
      for (int kk = 0; kk < kGroup; ++kk) {
        const int q = code_unsigned(F, qg, r, kk);
        const float a = kk < 16 ? a0 : a1;
        const float w = F == Q6K ? static_cast<float>(q - 32) * a : static_cast<float>(q) * a - b;
        const int64_t at = (k + kk) * p.n + row;
        if (p.bf16) {
          static_cast<uint16_t*>(p.out)[at] = float_to_bf16_bits(w);
        } else {
          static_cast<float*>(p.out)[at] = w;
        }
      }
    }
  }
}

#ifdef KILN_KQ_X86

// Byte i of every 32-bit lane of v shifted right by `shift`, masked: one K index's codes (or high
// bits), a row per lane.
KILN_KQ_AVX512 inline __m512i lane_bits(__m512i v, int shift, int mask) {
  return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask));
}

// Group j's factors for a tile's 16 rows, as scales_avx512 computes them: Q4_K / Q5_K a0 = a1 = d*sc,
// b = -(dmin*m); Q6_K a0, a1 the halves' d*sc.
template <int F>
KILN_KQ_AVX512 inline void group_scales_avx512(const uint8_t* sb, int j, __m512& a0, __m512& a1, __m512& b) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
  if (F == Q6K) {
    const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j) * 16));
    const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j + 1) * 16));
    a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0)));
    a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1)));
    b = _mm512_setzero_ps();
    return;
  }
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
  __m128i B[12];
  for (int i = 0; i < 12; ++i) B[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * i));
  __m128i sc, m;
  scale_min_bytes(B, j, sc, m);
  a0 = a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
  const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
  b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

KILN_KQ_AVX512 inline void store16_t(const DenseT& p, int64_t kk, int64_t row0, __mmask16 m, __m512 w) {
  if (p.bf16) {
    uint16_t* o = static_cast<uint16_t*>(p.out) + kk * p.n + row0;
    _mm256_mask_storeu_epi16(o, m, _mm512_cvtepi32_epi16(kiln::bf16_bits16(w)));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + kk * p.n + row0, m, w);
  }
}

// One tile's 16 rows of group j: the factors and codes of its 32 K indices, each a row per lane.
template <int F>
struct GroupT {
  __m512 a0, a1, b;
  __m512i h0, h1;
  const uint8_t* qg;
};

template <int F>
KILN_KQ_AVX512 inline void group_t_load(const DenseT& p, int64_t t, int64_t s, int j, GroupT<F>& g) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  g.qg = p.qs + (t * p.S + s) * QS + j * QB;
  group_scales_avx512<F>(p.sc + (t * p.S + s) * SB, j, g.a0, g.a1, g.b);
  g.h0 = g.h1 = _mm512_setzero_si512();
  if (F != Q4K) g.h0 = _mm512_loadu_si512(g.qg + 256);
  if (F == Q6K) g.h1 = _mm512_loadu_si512(g.qg + 320);
}

// K indices 4c+i (wl) and 16+4c+i (wh) of the group, a row per lane
template <int F>
KILN_KQ_AVX512 inline void group_t_values(const GroupT<F>& g, __m512i v, int c, int i, __m512& wl, __m512& wh) {
  __m512i ql = lane_bits(v, 8 * i, 15), qh = lane_bits(v, 8 * i + 4, 15);
  if (F == Q5K) {
    ql = _mm512_or_si512(ql, _mm512_slli_epi32(lane_bits(g.h0, 8 * i + c, 1), 4));
    qh = _mm512_or_si512(qh, _mm512_slli_epi32(lane_bits(g.h0, 8 * i + 4 + c, 1), 4));
  } else if (F == Q6K) {
    const __m512i off = _mm512_set1_epi32(32);
    ql = _mm512_sub_epi32(_mm512_or_si512(ql, _mm512_slli_epi32(lane_bits(g.h0, 8 * i + 2 * c, 3), 4)), off);
    qh = _mm512_sub_epi32(_mm512_or_si512(qh, _mm512_slli_epi32(lane_bits(g.h1, 8 * i + 2 * c, 3), 4)), off);
  }
  wl = _mm512_mul_ps(_mm512_cvtepi32_ps(ql), g.a0);
  wh = _mm512_mul_ps(_mm512_cvtepi32_ps(qh), g.a1);
  if (F != Q6K) {   // never + 0.0f for Q6_K: it would turn -0.0 into +0.0
    wl = _mm512_add_ps(wl, g.b);
    wh = _mm512_add_ps(wh, g.b);
  }
}

KILN_KQ_AVX512 inline __m256i bf16x16(__m512 w) { return _mm512_cvtepi32_epi16(kiln::bf16_bits16(w)); }

// Tiles t0:t1 of superblock s: group by group, each tile's 32 K indices stored as runs of its rows; in
// bfloat16 two whole tiles at a time, so each store fills a 64-byte line.
template <int F>
KILN_KQ_AVX512 void block_t_avx512(const DenseT& p, int64_t t0, int64_t t1, int64_t s) {
  for (int j = 0; j < 8; ++j) {
    const int64_t k = (s - p.s0) * kSuper + j * kGroup;
    int64_t t = t0;
    if (p.bf16 && F != Q6K) {   // Q6_K's two tiles of codes and high bits at once ran slower
      for (; t + 1 < t1 && (t + 2) * kRows <= p.n; t += 2) {
        GroupT<F> ga, gb;
        group_t_load<F>(p, t, s, j, ga);
        group_t_load<F>(p, t + 1, s, j, gb);
        uint16_t* o = static_cast<uint16_t*>(p.out) + t * kRows;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i va = _mm512_loadu_si512(ga.qg + c * 64), vb = _mm512_loadu_si512(gb.qg + c * 64);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            __m512 la, ha, lb, hb;
            group_t_values<F>(ga, va, c, i, la, ha);
            group_t_values<F>(gb, vb, c, i, lb, hb);
            _mm512_storeu_si512(o + (k + 4 * c + i) * p.n, _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(la)), bf16x16(lb), 1));
            _mm512_storeu_si512(o + (k + 16 + 4 * c + i) * p.n, _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(ha)), bf16x16(hb), 1));
          }
        }
      }
    }
    for (; t < t1; ++t) {
      const int64_t rows = p.n - t * kRows < kRows ? p.n - t * kRows : kRows, row0 = t * kRows;
      const __mmask16 m = static_cast<__mmask16>((1u << rows) - 1u);
      GroupT<F> g;
      group_t_load<F>(p, t, s, j, g);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(g.qg + c * 64);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          __m512 wl, wh;
          group_t_values<F>(g, v, c, i, wl, wh);
          store16_t(p, k + 4 * c + i, row0, m, wl);
          store16_t(p, k + 16 + 4 * c + i, row0, m, wh);
        }
      }
    }
  }
}

KILN_KQ_AVX2 inline __m256i lane_bits8(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(mask));
}

// scales_avx2's factors of group j for half h of a tile's rows (see group_scales_avx512)
template <int F>
KILN_KQ_AVX2 inline void group_scales_avx2(const uint8_t* sb, int h, int j, __m256& a0, __m256& a1, __m256& b) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
  if (F == Q6K) {
    const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j) * 16 + 8 * h));
    const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j + 1) * 16 + 8 * h));
    a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s0)));
    a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s1)));
    b = _mm256_setzero_ps();
    return;
  }
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * h)));
  __m128i B[12];
  for (int i = 0; i < 12; ++i) B[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 16 * i + 8 * h));
  __m128i sc, m;
  scale_min_bytes(B, j, sc, m);
  a0 = a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
  b = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))),
                    _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));
}

// block_t_avx512's order, 8 rows at a time (a partial tile goes through the scalar path)
template <int F>
KILN_KQ_AVX2 void block_t_avx2(const DenseT& p, int64_t t0, int64_t t1, int64_t s) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  for (int j = 0; j < 8; ++j) {
    const int64_t k = (s - p.s0) * kSuper + j * kGroup;
    for (int64_t t = t0; t < t1; ++t) {
      if (p.n - t * kRows < kRows) {
        if (j == 0) tile_t_scalar<F>(p, t, s);
        continue;
      }
      const uint8_t* qg = p.qs + (t * p.S + s) * QS + j * QB;
      for (int h = 0; h < 2; ++h) {
        const int64_t row0 = t * kRows + 8 * h;
        __m256 a0, a1, b;
        group_scales_avx2<F>(p.sc + (t * p.S + s) * SB, h, j, a0, a1, b);
        __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
        if (F != Q4K) h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 256 + 32 * h));
        if (F == Q6K) h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 320 + 32 * h));
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32 * h));
          for (int i = 0; i < 4; ++i) {
            __m256i ql = lane_bits8(v, 8 * i, 15), qh = lane_bits8(v, 8 * i + 4, 15);
            if (F == Q5K) {
              ql = _mm256_or_si256(ql, _mm256_slli_epi32(lane_bits8(h0, 8 * i + c, 1), 4));
              qh = _mm256_or_si256(qh, _mm256_slli_epi32(lane_bits8(h0, 8 * i + 4 + c, 1), 4));
            } else if (F == Q6K) {
              const __m256i off = _mm256_set1_epi32(32);
              ql = _mm256_sub_epi32(_mm256_or_si256(ql, _mm256_slli_epi32(lane_bits8(h0, 8 * i + 2 * c, 3), 4)), off);
              qh = _mm256_sub_epi32(_mm256_or_si256(qh, _mm256_slli_epi32(lane_bits8(h1, 8 * i + 2 * c, 3), 4)), off);
            }
            __m256 wl = _mm256_mul_ps(_mm256_cvtepi32_ps(ql), a0), wh = _mm256_mul_ps(_mm256_cvtepi32_ps(qh), a1);
            if (F != Q6K) {
              wl = _mm256_add_ps(wl, b);
              wh = _mm256_add_ps(wh, b);
            }
            const int64_t kl = k + 4 * c + i, kh = k + 16 + 4 * c + i;
            if (p.bf16) {
              uint16_t* o = static_cast<uint16_t*>(p.out) + row0;
              kiln::store_bf16_bits8(o + kl * p.n, kiln::bf16_bits8(wl));
              kiln::store_bf16_bits8(o + kh * p.n, kiln::bf16_bits8(wh));
            } else {
              float* o = static_cast<float*>(p.out) + row0;
              _mm256_storeu_ps(o + kl * p.n, wl);
              _mm256_storeu_ps(o + kh * p.n, wh);
            }
          }
        }
      }
    }
  }
}
#endif

// A task: kBlockTiles tiles of one superblock.
template <int F>
void dequantize_t_all(const DenseT& p, int64_t isa, bool torch_threads) {
  const int64_t T = (p.n + kRows - 1) / kRows, blocks = (T + kBlockTiles - 1) / kBlockTiles;
  const int64_t tasks = blocks * (p.s1 - p.s0);
  auto task = [&](int64_t c) {
    const int64_t s = p.s0 + c / blocks, t0 = (c % blocks) * kBlockTiles;
    const int64_t t1 = t0 + kBlockTiles < T ? t0 + kBlockTiles : T;
#ifdef KILN_KQ_X86
    if (isa >= kiln::ISA_AVX512) return block_t_avx512<F>(p, t0, t1, s);
    if (isa >= kiln::ISA_AVX2) return block_t_avx2<F>(p, t0, t1, s);
#endif
    for (int64_t t = t0; t < t1; ++t) tile_t_scalar<F>(p, t, s);
  };
  if (torch_threads) {
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) task(c);
    });
  } else {
    kiln::parallel_tasks(tasks, task);
  }
}

template <typename Fn>
void run_tasks(int64_t n, bool torch_threads, const Fn& fn) {
  if (!torch_threads) return kiln::parallel_tasks(n, fn);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

template <int F>
void dequantize_all(const Dense& p, int64_t isa, bool torch_threads) {
  const int64_t T = (p.n + kRows - 1) / kRows;
#ifdef KILN_KQ_X86
  if (isa >= kiln::ISA_AVX512) return run_tasks(T, torch_threads, [&](int64_t t) { tile_avx512<F>(p, t); });
  if (isa >= kiln::ISA_AVX2) return run_tasks(T, torch_threads, [&](int64_t t) { tile_avx2<F>(p, t); });
#endif
  run_tasks(T, torch_threads, [&](int64_t t) { tile_scalar<F>(p, t); });
}


// The [rows, cols] result: `out` when given (checked), else a new tensor.
torch::Tensor output(const torch::Tensor& qs, const c10::optional<torch::Tensor>& out, int64_t rows, int64_t cols,
                     bool bf16, const char* what) {
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  if (!(out.has_value() && out->defined())) return torch::empty({rows, cols}, qs.options().dtype(dtype));
  const torch::Tensor& y = *out;
  TORCH_CHECK_VALUE(y.device().is_cpu() && y.scalar_type() == dtype && y.is_contiguous() && y.numel() == rows * cols,
                    what, ": out must be a contiguous CPU ", bf16 ? "bfloat16" : "float32", " tensor of ",
                    rows * cols, " values");
  return y;
}

}  // namespace

namespace kiln {

int kquant_checked_format(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n, int64_t k,
                           const char* what) {
  TORCH_CHECK_VALUE(fmt >= Q4K && fmt <= Q6K, what, ": unknown format ", fmt);
  const int f = static_cast<int>(fmt);
  const int64_t S = k / kSuper, T = (n + kRows - 1) / kRows;
  TORCH_CHECK_VALUE(k % kSuper == 0 && qs.is_contiguous() && scales.is_contiguous() &&
                        qs.numel() >= T * S * super_bytes(f) && scales.numel() >= T * S * scale_bytes(f),
                    what, ": the tiles do not match n = ", n, ", k = ", k);
  return f;
}

void kquant_decode_superblock(int fmt, int64_t isa, const uint8_t* qs, const uint8_t* sc, int64_t rows, uint16_t* out) {
  const Dense p{qs, sc, 1, rows, kSuper, true, out};
#ifdef KILN_KQ_X86
  if (isa >= ISA_AVX512) {
    if (fmt == Q4K) return tile_avx512<Q4K>(p, 0);
    if (fmt == Q5K) return tile_avx512<Q5K>(p, 0);
    return tile_avx512<Q6K>(p, 0);
  }
  if (isa >= ISA_AVX2) {
    if (fmt == Q4K) return tile_avx2<Q4K>(p, 0);
    if (fmt == Q5K) return tile_avx2<Q5K>(p, 0);
    return tile_avx2<Q6K>(p, 0);
  }
#endif
  if (fmt == Q4K) return tile_scalar<Q4K>(p, 0);
  if (fmt == Q5K) return tile_scalar<Q5K>(p, 0);
  tile_scalar<Q6K>(p, 0);
}

torch::Tensor kquant_dequantize(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                int64_t k, bool bf16, int64_t isa, const c10::optional<torch::Tensor>& out,
                                bool torch_threads) {
  const int f = kquant_checked_format(qs, scales, fmt, n, k, "kquant_dequantize");
  const int64_t S = k / kSuper;
  const int64_t level = resolve_isa(isa, "kiln kquant_dequantize");
  torch::Tensor y = output(qs, out, n, k, bf16, "kquant_dequantize");
  if (n == 0 || k == 0) return y;
  const Dense p{qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), S, n, k, bf16, y.data_ptr()};
  if (f == Q4K) dequantize_all<Q4K>(p, level, torch_threads);
  else if (f == Q5K) dequantize_all<Q5K>(p, level, torch_threads);
  else dequantize_all<Q6K>(p, level, torch_threads);
  return y;
}

torch::Tensor kquant_dequantize_t(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                  int64_t k, int64_t k0, int64_t k1, bool bf16, int64_t isa,
                                  const c10::optional<torch::Tensor>& out, bool torch_threads) {
  const int f = kquant_checked_format(qs, scales, fmt, n, k, "kquant_dequantize_t");
  const int64_t S = k / kSuper;
  TORCH_CHECK_VALUE(0 <= k0 && k0 <= k1 && k1 <= k && k0 % kSuper == 0 && k1 % kSuper == 0,
                    "kquant_dequantize_t: columns ", k0, ":", k1, " must be whole superblocks of k = ", k);
  const int64_t level = resolve_isa(isa, "kiln kquant_dequantize_t");
  torch::Tensor y = output(qs, out, k1 - k0, n, bf16, "kquant_dequantize_t");
  if (n == 0 || k1 == k0) return y;
  const DenseT p{qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), S, n, k0 / kSuper, k1 / kSuper, bf16,
                 y.data_ptr()};
  if (f == Q4K) dequantize_t_all<Q4K>(p, level, torch_threads);
  else if (f == Q5K) dequantize_t_all<Q5K>(p, level, torch_threads);
  else dequantize_t_all<Q6K>(p, level, torch_threads);
  return y;
}

}  // namespace kiln
