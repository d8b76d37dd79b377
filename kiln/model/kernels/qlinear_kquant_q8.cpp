// K-quant weights (GGUF Q4_K, Q5_K, Q6_K) with 8-bit activations, as llama.cpp multiplies them, on the
// same tiles qlinear_kquant.cpp reads (kquant_tiles.h). The activations are quantized per superblock of
// 256 as llama.cpp's Q8_K is (quantize_super.cpp: int8 xq, one scale xd = amax / 127, the int8 sums of
// every 16 and every 32 values), so a superblock's sub-block scales apply in INTEGER arithmetic: per
// weight row r and superblock, exact in int32 (at most ~2^28 in magnitude),
//   Q4_K / Q5_K, codes q (0..15 / 0..31), group j (32 values) with 6-bit scale sc_j and min m_j:
//     isum = sum_j sc_j * (sum q * xq),  msum = sum_j m_j * (xq's sum over group j)
//     acc = fma(float(msum), -(dmin * xd), acc); acc = fma(float(isum), d * xd, acc)
//   Q6_K, stored codes u = q + 32 (0..63), sub-block b (16 values) with int8 scale sc_b:
//     isum = sum_b sc_b * (sum u * xq) - 32 * sum_b sc_b * (xq's sum over b)
//     acc = fma(float(isum), d * xd, acc)
// One float conversion and fma (two for the mins) a superblock and activation row, where a per-32
// quantization paid a convert, a multiply and two fmas per group of 32.
//
// A tile's 16 rows are the int32 lanes (4 consecutive K values a lane, as the tiles store them):
// AVX512-VNNI: vpdpbusd with 4 activation bytes broadcast advances 16 rows; a group's dot product is
// scaled by vpmulld into the superblock's sum; the mins and the Q6_K offset are vpdpwssd of scale pairs
// with pairs of the int16 sums. AVX2 (8 rows a vector): maddubs gives int16 pairs, several of them add up
// in int16 while no sum can reach 2^15, and madd with the sub-block scale (instead of with ones) scales
// and widens them in one instruction.
//
// Every output is one fixed sequence of operations (exact integer sums, then the float32 operations above
// in superblock order), whatever M, the row block, the thread or the ISA, so the scalar, AVX2 and AVX-512
// paths give the same bits and a row's result never depends on its batch.

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

using kiln::dpbusd_bcast;
using kiln::half_bits_to_float;
using namespace kiln::kq;

constexpr int kMaxMB = 8;      // activation rows a pass over a tile serves (AVX512-VNNI; AVX2 takes 4)
constexpr int kMaxMBAvx2 = 4;  // 16 ymm registers: 3 accumulators a row
constexpr int kWideRows = 32;  // AVX2 from kWideMinRows rows: a tile's codes serve blocks of up to 32 rows
constexpr int64_t kWideMinRows = 4;   // fewer: 4-row blocks (one or two rows read tiles side by side)

struct Problem {
  int64_t fmt, M, N, S;
  const uint8_t* qs;      // [T, S, super_bytes]
  const uint8_t* sc;      // [T, S, scale_bytes]
  const int8_t* xq;       // [M, S * 256] int8 activations
  const float* xd;        // [M, S] their scale per superblock
  const int16_t* b16;     // [M, S * 16] the int8 sums of every 16 activations (Q6_K's offset)
  const int16_t* b32;     // [M, S * 8] the int8 sums of every 32 (the mins of Q4_K / Q5_K)
  const int8_t* xgm;      // AVX2, M >= kWideMinRows: xq group-major per block of kWideRows rows, else nullptr
  const float* bias;      // [T * 16] or nullptr
  void* out;              // [M, N]
  bool out_bf16;
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  store_tile_row(p.out, p.out_bf16, p.N, p.bias, m, t, acc);
}

// ---------------------------------------------------------------- scalar reference

void tile_scalar(const Problem& p, int64_t t, int64_t m) {
  const int f = static_cast<int>(p.fmt);
  const int64_t QS = super_bytes(f), SB = scale_bytes(f), K = p.S * kSuper;
  float acc[kRows] = {};
  for (int64_t s = 0; s < p.S; ++s) {
    const uint8_t* sb = p.sc + (t * p.S + s) * SB;
    const uint8_t* qsb = p.qs + (t * p.S + s) * QS;
    const int8_t* x = p.xq + m * K + s * kSuper;
    const int16_t* b16 = p.b16 + (m * p.S + s) * 16;
    const int16_t* b32 = p.b32 + (m * p.S + s) * 8;
    const float xd = p.xd[m * p.S + s];
    for (int r = 0; r < kRows; ++r) {
      const float d = half_bits_to_float(load_u16(sb + 2 * r));
      int32_t isum = 0;
      if (f == Q6K) {
        int32_t off = 0;
        for (int b = 0; b < 16; ++b) {
          const int32_t sc = static_cast<int8_t>(sb[32 + b * 16 + r]);
          const uint8_t* qg = qsb + (b / 2) * group_bytes(f);
          int32_t dot = 0;
          for (int k = 0; k < 16; ++k) dot += code_unsigned(f, qg, r, 16 * (b % 2) + k) * x[16 * b + k];
          isum += sc * dot;
          off += sc * b16[b];
        }
        isum -= 32 * off;
      } else {
        int32_t msum = 0;
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min_scalar(sb, r, j, sc, mn);
          const uint8_t* qg = qsb + j * group_bytes(f);
          int32_t dot = 0;
          for (int k = 0; k < kGroup; ++k) dot += code_unsigned(f, qg, r, k) * x[kGroup * j + k];
          isum += sc * dot;
          msum += mn * b32[j];
        }
        const float dmin = half_bits_to_float(load_u16(sb + 32 + 2 * r));
        acc[r] = std::fma(static_cast<float>(msum), -(dmin * xd), acc[r]);
      }
      acc[r] = std::fma(static_cast<float>(isum), d * xd, acc[r]);
    }
  }
  store(p, m, t, acc);
}

#ifdef KILN_KQ_X86
#define KILN_KQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

inline int32_t load_i32(const void* b) {
  int32_t v;
  std::memcpy(&v, b, 4);
  return v;
}

// Group j's 6-bit scales (sc) and mins (m) of 16 rows (Half: the 8 rows of half rh), GGUF's
// get_scale_min_k4 per byte, reading only the three scale bytes group j needs.
template <bool Half>
KILN_KQ_AVX2 inline void scale_min_at(const uint8_t* sb, int j, int rh, __m128i& sc, __m128i& m) {
  const auto L = [&](int b) {
    const __m128i* q = reinterpret_cast<const __m128i*>(sb + 64 + 16 * b + 8 * rh);
    return Half ? _mm_loadl_epi64(q) : _mm_loadu_si128(q);
  };
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3);
  if (j < 4) {
    sc = _mm_and_si128(L(j), m63);
    m = _mm_and_si128(L(j + 4), m63);
  } else {
    const __m128i b4 = L(j + 4);
    const __m128i top_lo = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(L(j - 4), 6), m3), 4);
    const __m128i top_hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(L(j), 6), m3), 4);
    sc = _mm_or_si128(_mm_and_si128(b4, m15), top_lo);
    m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b4, 4), m15), top_hi);
  }
}

// ------------------------------------------------------------ AVX512-VNNI: a tile's 16 rows in one vector

// dword lane r = (lo[r], hi[r]) as two int16: what vpdpwssd multiplies with a pair of int16 sums
KILN_KQ_VNNI inline __m512i pairs16(__m512i lo, __m512i hi) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, _mm512_slli_epi32(hi, 16));
}

// Q6_K's unsigned codes (0..63) of half h (K 16h + 4c + i) of group qg, 16 rows: the low nibble, and
// the two high bits put in place by one shift and one vpternlogd ((hi & 0x30) | lo) instead of shift,
// mask, shift, or (one-row decode GEMV, 1B's Q6_K ffn_down: 15% less CPU time a call). c must be a
// constant where this inlines (the callers' c loops unroll): otherwise the shift is picked at run time.
KILN_KQ_VNNI inline __m512i q6_half_avx512(const uint8_t* qg, int c, int h) {
  const __m512i m15 = _mm512_set1_epi8(15), m48 = _mm512_set1_epi8(0x30);
  const __m512i v = _mm512_loadu_si512(qg + c * 64);
  const __m512i n = h ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m15) : _mm512_and_si512(v, m15);
  // bits 2c, 2c+1 of each byte to bits 4, 5 by one 16-bit shift (c is a constant once the callers'
  // loops unroll); what crosses into a neighbouring byte lands outside bits 4-5, masked away
  const __m512i hb = _mm512_loadu_si512(qg + 256 + 64 * h);
  const __m512i hi = c < 2 ? _mm512_slli_epi16(hb, 4 - 2 * c) : c == 3 ? _mm512_srli_epi16(hb, 2) : hb;
  return _mm512_ternarylogic_epi32(hi, n, m48, 0xEC);   // (hi & m48) | n
}

// Q6_K's offset, -32 * sc_b * (sub-block b's activation sum): for one or two activation rows it joins
// each sub-block's product with the scale that multiplies it (AVX-512: the dot product starts at -32 *
// that sum; AVX2: one more madd of the scale pairs; one row at 1B's Q6_K shapes, AVX-512: 5-15% more GB/s
// a thread, AVX2 with q6_half_avx2's single shift: 13-38%); for more rows, whose broadcasts would outnumber
// it, once a superblock as pairs of scales against pairs of sums.
template <int MB>
constexpr bool q6_offset_in_dot() { return MB <= 2; }

template <int F, int NT, int MB>
KILN_KQ_VNNI void tiles_vnni(const Problem& p, int64_t t, int64_t m0, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  constexpr bool kTwoChains = NT * MB <= 4;   // few independent rows: split a group's dot product in two
  constexpr bool kOffsetInDot = q6_offset_in_dot<MB>();
  const int64_t S = p.S, K = S * kSuper;
  const __m512i m15 = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  __m512 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb[NT];
    const uint8_t* qb[NT];
    for (int a = 0; a < NT; ++a) {
      sb[a] = p.sc + ((t + a) * S + s) * SB;
      qb[a] = p.qs + ((t + a) * S + s) * QS;
    }
    __m512i isum[NT][MB];
    for (int a = 0; a < NT; ++a)
      for (int j = 0; j < MB; ++j) isum[a][j] = zero;
    if constexpr (F == Q6K && !kOffsetInDot) {   // isum starts at -32 * sum_b sc_b * (sub-block b's sum)
      for (int q = 0; q < 8; ++q)
        for (int a = 0; a < NT; ++a) {
          const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[a] + 32 + 32 * q)));
          const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[a] + 48 + 32 * q)));
          const __m512i pr = pairs16(_mm512_sub_epi32(zero, _mm512_slli_epi32(lo, 5)),
                                     _mm512_sub_epi32(zero, _mm512_slli_epi32(hi, 5)));
          for (int j = 0; j < MB; ++j)
            isum[a][j] = _mm512_dpwssd_epi32(isum[a][j], pr,
                                             _mm512_set1_epi32(load_i32(p.b16 + ((m0 + j) * S + s) * 16 + 2 * q)));
        }
    } else if constexpr (F != Q6K) {   // the mins: acc = fma(float(msum), -(dmin * xd), acc)
      __m512i ms[NT][MB];
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) ms[a][j] = zero;
      for (int q = 0; q < 4; ++q)
        for (int a = 0; a < NT; ++a) {
          __m128i sc0, mn0, sc1, mn1;
          scale_min_at<false>(sb[a], 2 * q, 0, sc0, mn0);
          scale_min_at<false>(sb[a], 2 * q + 1, 0, sc1, mn1);
          const __m512i pr = pairs16(_mm512_cvtepu8_epi32(mn0), _mm512_cvtepu8_epi32(mn1));
          for (int j = 0; j < MB; ++j)
            ms[a][j] = _mm512_dpwssd_epi32(ms[a][j], pr,
                                           _mm512_set1_epi32(load_i32(p.b32 + ((m0 + j) * S + s) * 8 + 2 * q)));
        }
      for (int a = 0; a < NT; ++a) {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[a] + 32)));
        for (int j = 0; j < MB; ++j) {
          const __m512 f = _mm512_mul_ps(dmin, _mm512_set1_ps(p.xd[(m0 + j) * S + s]));
          acc[a][j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms[a][j]), f, acc[a][j]);
        }
      }
    }
    for (int g = 0; g < 8; ++g) {
      for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, S, t + a, s, g, NT);
      const int64_t xo = s * kSuper + g * kGroup;
      if constexpr (F == Q6K) {
        for (int h = 0; h < 2; ++h) {
          __m512i dot[NT][MB];
          for (int j = 0; j < MB; ++j) {
            const __m512i start =
                kOffsetInDot ? _mm512_set1_epi32(-32 * p.b16[((m0 + j) * S + s) * 16 + 2 * g + h]) : zero;
            for (int a = 0; a < NT; ++a) dot[a][j] = start;
          }
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            __m512i v[NT];
            for (int a = 0; a < NT; ++a) v[a] = q6_half_avx512(qb[a] + g * QB, c, h);
            for (int j = 0; j < MB; ++j) {
              const int8_t* xp = p.xq + (m0 + j) * K + xo + 16 * h + 4 * c;
              for (int a = 0; a < NT; ++a) dot[a][j] = dpbusd_bcast(dot[a][j], v[a], xp);
            }
          }
          for (int a = 0; a < NT; ++a) {
            const __m512i sc = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[a] + 32 + (2 * g + h) * 16)));
            for (int j = 0; j < MB; ++j) isum[a][j] = _mm512_add_epi32(isum[a][j], _mm512_mullo_epi32(dot[a][j], sc));
          }
        }
      } else {
        __m512i dl[NT][MB], dh[NT][MB];
        for (int a = 0; a < NT; ++a)
          for (int j = 0; j < MB; ++j) dl[a][j] = dh[a][j] = zero;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m512i vl[NT], vh[NT];
          for (int a = 0; a < NT; ++a) {
            codes_avx512<F, false>(qb[a] + g * QB, c, vl[a], vh[a]);
            if (F == Q4K) {   // codes_avx512 leaves Q4_K's nibble pairs together
              vh[a] = _mm512_and_si512(_mm512_srli_epi16(vl[a], 4), m15);
              vl[a] = _mm512_and_si512(vl[a], m15);
            }
          }
          for (int j = 0; j < MB; ++j) {
            const int8_t* xg = p.xq + (m0 + j) * K + xo;
            for (int a = 0; a < NT; ++a) {
              dl[a][j] = dpbusd_bcast(dl[a][j], vl[a], xg + 4 * c);
              if (kTwoChains) dh[a][j] = dpbusd_bcast(dh[a][j], vh[a], xg + 16 + 4 * c);
              else dl[a][j] = dpbusd_bcast(dl[a][j], vh[a], xg + 16 + 4 * c);
            }
          }
        }
        for (int a = 0; a < NT; ++a) {
          __m128i sc, mn;
          scale_min_at<false>(sb[a], g, 0, sc, mn);
          const __m512i scv = _mm512_cvtepu8_epi32(sc);
          for (int j = 0; j < MB; ++j) {
            const __m512i dot = kTwoChains ? _mm512_add_epi32(dl[a][j], dh[a][j]) : dl[a][j];
            isum[a][j] = _mm512_add_epi32(isum[a][j], _mm512_mullo_epi32(dot, scv));
          }
        }
      }
    }
    for (int a = 0; a < NT; ++a) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb[a])));
      for (int j = 0; j < MB; ++j) {
        const __m512 f = _mm512_mul_ps(d, _mm512_set1_ps(p.xd[(m0 + j) * S + s]));
        acc[a][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[a][j]), f, acc[a][j]);
      }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out[a][j], acc[a][j]);
}

// ------------------------------------------------------------ AVX2: half rh of a tile (8 rows) a vector

KILN_KQ_AVX2 inline __m256i pairs16_avx2(__m256i lo, __m256i hi) {
  return _mm256_blend_epi16(lo, _mm256_slli_epi32(hi, 16), 0xAA);
}

// Q6_K's unsigned codes of half h of group qg, rows half rh: the low nibble, and the two high bits put
// in place by one 16-bit shift (none for c = 2) and one mask, as q6_half_avx512 does. c must be a
// constant where this inlines (the callers' c loops unroll): picked at run time, the shift cost 25%.
KILN_KQ_AVX2 inline __m256i q6_half_avx2(const uint8_t* qg, int c, int h, int rh) {
  const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32 * rh));
  const __m256i n = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m15) : _mm256_and_si256(v, m15);
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 256 + 64 * h + 32 * rh));
  // bits 2c, 2c+1 of each byte to bits 4, 5; what crosses into a neighbouring byte lands outside them
  const __m256i hi = c < 2 ? _mm256_slli_epi16(hb, 4 - 2 * c) : c == 3 ? _mm256_srli_epi16(hb, 2) : hb;
  return _mm256_or_si256(n, _mm256_and_si256(hi, m48));
}

// The int16 pairs madd multiplies a row half's (rh) integer sums with, 8 rows' lanes:
// Q6_K's offset: -32 * the scales of sub-blocks 2q and 2q + 1 (against their activations' int8 sums)
KILN_KQ_AVX2 inline __m256i q6_offset_pair_avx2(const uint8_t* sb, int q, int rh) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + 32 * q + 8 * rh)));
  const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 48 + 32 * q + 8 * rh)));
  return pairs16_avx2(_mm256_sub_epi32(zero, _mm256_slli_epi32(lo, 5)), _mm256_sub_epi32(zero, _mm256_slli_epi32(hi, 5)));
}

// Q4_K / Q5_K: the mins of groups 2q and 2q + 1
KILN_KQ_AVX2 inline __m256i min_pair_avx2(const uint8_t* sb, int q, int rh) {
  __m128i sc0, mn0, sc1, mn1;
  scale_min_at<true>(sb, 2 * q, rh, sc0, mn0);
  scale_min_at<true>(sb, 2 * q + 1, rh, sc1, mn1);
  return pairs16_avx2(_mm256_cvtepu8_epi32(mn0), _mm256_cvtepu8_epi32(mn1));
}

// Q4_K / Q5_K: a superblock's 6-bit scales (sm[0][j]) and mins (sm[1][j]) of group j, a byte for each of
// the tile's 16 rows, unpacked once from the 12 scale bytes a row (the 4- and 2-bit pieces of GGUF's
// get_scale_min_k4), where one activation row decoded each group's three bytes for its scale and again
// for its min (AVX2, 1B's Q4_K shapes: 5% more GB/s a thread, Q5_K 2%).
KILN_KQ_AVX2 inline void unpack_scales_mins(const uint8_t* sb, uint8_t (*sm)[8][16]) {
  __m128i B[12];
  for (int b = 0; b < 12; ++b) B[b] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * b));
  for (int j = 0; j < 8; ++j) {
    __m128i sc, m;
    scale_min_bytes(B, j, sc, m);
    _mm_store_si128(reinterpret_cast<__m128i*>(sm[0][j]), sc);
    _mm_store_si128(reinterpret_cast<__m128i*>(sm[1][j]), m);
  }
}

// 8 bytes (a value for each of a half's 8 rows) widened to the rows' int32 lanes
KILN_KQ_AVX2 inline __m256i bytes_to_lanes(const uint8_t* b) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

// The scale of group g (Q4_K / Q5_K) or of sub-block b (Q6_K) in both halves of each lane
KILN_KQ_AVX2 inline __m256i group_scale_avx2(const uint8_t* sb, int g, int rh) {
  __m128i sc, mn;
  scale_min_at<true>(sb, g, rh, sc, mn);
  const __m256i s32 = _mm256_cvtepu8_epi32(sc);
  return pairs16_avx2(s32, s32);
}
KILN_KQ_AVX2 inline __m256i q6_scale_avx2(const uint8_t* sb, int b, int rh) {
  const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + b * 16 + 8 * rh)));
  return pairs16_avx2(s32, s32);
}

// maddubs pairs an unsigned code byte with a signed activation byte (|xq| <= 127) into int16, and
// several of those add up in int16 before madd scales them: Q4_K 8 (8 * 2 * 15 * 127 = 30480), Q5_K 4
// (4 * 2 * 31 * 127 = 31496), Q6_K 2 (2 * 2 * 63 * 127 = 32004), never past 32767.
//
// U = NT * H vectors side by side: NT tiles, each in H halves (H = 2: both of a tile's halves in one pass,
// every code byte read once; H = 1: half rh0 only, the caller runs the other half next).
template <int F, int NT, int MB, int H>
KILN_KQ_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0, int rh0, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  constexpr int U = NT * H;
  int rhs[U];
  for (int a = 0; a < U; ++a) rhs[a] = H == 2 ? a % 2 : rh0;
  constexpr bool kOffsetInDot = q6_offset_in_dot<MB>();
  const int64_t S = p.S, K = S * kSuper;
  const __m256i zero = _mm256_setzero_si256();
  // Q4_K / Q5_K, one activation row: the superblock's scales and mins unpacked once (more rows: each
  // group's decoded where it is used, 1-5% faster there)
  constexpr bool kUnpackScales = F != Q6K && MB == 1;
  alignas(16) uint8_t sm[NT][2][8][16];
  __m256 acc[U][MB];
  for (int a = 0; a < U; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb[U];
    const uint8_t* qb[U];
    for (int a = 0; a < U; ++a) {
      sb[a] = p.sc + ((t + a / H) * S + s) * SB;
      qb[a] = p.qs + ((t + a / H) * S + s) * QS;
    }
    __m256i isum[U][MB];
    for (int a = 0; a < U; ++a)
      for (int j = 0; j < MB; ++j) isum[a][j] = zero;
    if constexpr (F == Q6K && !kOffsetInDot) {
      for (int q = 0; q < 8; ++q)
        for (int a = 0; a < U; ++a) {
          const __m256i pr = q6_offset_pair_avx2(sb[a], q, rhs[a]);
          for (int j = 0; j < MB; ++j)
            isum[a][j] = _mm256_add_epi32(isum[a][j], _mm256_madd_epi16(pr, _mm256_set1_epi32(load_i32(
                                                          p.b16 + ((m0 + j) * S + s) * 16 + 2 * q))));
        }
    } else if constexpr (F != Q6K) {
      if constexpr (kUnpackScales)
        for (int tt = 0; tt < NT; ++tt) unpack_scales_mins(sb[tt * H], sm[tt]);
      __m256i ms[U][MB];
      for (int a = 0; a < U; ++a)
        for (int j = 0; j < MB; ++j) ms[a][j] = zero;
      for (int q = 0; q < 4; ++q)
        for (int a = 0; a < U; ++a) {
          const __m256i pr = kUnpackScales ? pairs16_avx2(bytes_to_lanes(sm[a / H][1][2 * q] + 8 * rhs[a]),
                                                          bytes_to_lanes(sm[a / H][1][2 * q + 1] + 8 * rhs[a]))
                                           : min_pair_avx2(sb[a], q, rhs[a]);
          for (int j = 0; j < MB; ++j)
            ms[a][j] = _mm256_add_epi32(ms[a][j], _mm256_madd_epi16(pr, _mm256_set1_epi32(load_i32(
                                                      p.b32 + ((m0 + j) * S + s) * 8 + 2 * q))));
        }
      for (int a = 0; a < U; ++a) {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[a] + 32 + 16 * rhs[a])));
        for (int j = 0; j < MB; ++j) {
          const __m256 f = _mm256_mul_ps(dmin, _mm256_set1_ps(p.xd[(m0 + j) * S + s]));
          acc[a][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms[a][j]), f, acc[a][j]);
        }
      }
    }
    for (int g = 0; g < 8; ++g) {
      if (rh0 == 0)
        for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, S, t + a, s, g, NT);
      const int64_t xo = s * kSuper + g * kGroup;
      if constexpr (F == Q6K) {
        for (int h = 0; h < 2; ++h) {
          __m256i scv[U];
          for (int a = 0; a < U; ++a) scv[a] = q6_scale_avx2(sb[a], 2 * g + h, rhs[a]);
          if constexpr (kOffsetInDot) {   // -32 * sc_b * sum: madd of the scale pairs with (-16 * sum) pairs
            for (int j = 0; j < MB; ++j) {   // |16 * sum| <= 16 * 16 * 127 = 32512: an int16
              const __m256i off = _mm256_set1_epi16(static_cast<int16_t>(-16 * p.b16[((m0 + j) * S + s) * 16 + 2 * g + h]));
              for (int a = 0; a < U; ++a) isum[a][j] = _mm256_add_epi32(isum[a][j], _mm256_madd_epi16(off, scv[a]));
            }
          }
#pragma GCC unroll 2
          for (int c0 = 0; c0 < 4; c0 += 2) {
            __m256i p16[U][MB];
#pragma GCC unroll 2
            for (int c = c0; c < c0 + 2; ++c) {
              __m256i v[U];
              for (int a = 0; a < U; ++a) v[a] = q6_half_avx2(qb[a] + g * QB, c, h, rhs[a]);
              for (int j = 0; j < MB; ++j) {
                const __m256i xb = _mm256_set1_epi32(load_i32(p.xq + (m0 + j) * K + xo + 16 * h + 4 * c));
                for (int a = 0; a < U; ++a) {
                  const __m256i pr = _mm256_maddubs_epi16(v[a], xb);
                  p16[a][j] = c == c0 ? pr : _mm256_add_epi16(p16[a][j], pr);
                }
              }
            }
            for (int a = 0; a < U; ++a)
              for (int j = 0; j < MB; ++j) isum[a][j] = _mm256_add_epi32(isum[a][j], _mm256_madd_epi16(p16[a][j], scv[a]));
          }
        }
      } else {
        constexpr int kPer = F == Q4K ? 4 : 2;   // c steps summed in int16 before one madd
        __m256i scv[U];
        for (int a = 0; a < U; ++a) {
          if constexpr (kUnpackScales) {
            const __m256i s32 = bytes_to_lanes(sm[a / H][0][g] + 8 * rhs[a]);
            scv[a] = pairs16_avx2(s32, s32);
          } else {
            scv[a] = group_scale_avx2(sb[a], g, rhs[a]);
          }
        }
        for (int c0 = 0; c0 < 4; c0 += kPer) {
          __m256i p16[U][MB];
          for (int c = c0; c < c0 + kPer; ++c) {
            __m256i vl[U], vh[U];
            for (int a = 0; a < U; ++a) codes_avx2<F, false>(qb[a] + g * QB, c, rhs[a], vl[a], vh[a]);
            for (int j = 0; j < MB; ++j) {
              const int8_t* xg = p.xq + (m0 + j) * K + xo;
              const __m256i xl = _mm256_set1_epi32(load_i32(xg + 4 * c));
              const __m256i xh = _mm256_set1_epi32(load_i32(xg + 16 + 4 * c));
              for (int a = 0; a < U; ++a) {
                const __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(vl[a], xl), _mm256_maddubs_epi16(vh[a], xh));
                p16[a][j] = c == c0 ? pr : _mm256_add_epi16(p16[a][j], pr);
              }
            }
          }
          for (int a = 0; a < U; ++a)
            for (int j = 0; j < MB; ++j) isum[a][j] = _mm256_add_epi32(isum[a][j], _mm256_madd_epi16(p16[a][j], scv[a]));
        }
      }
    }
    for (int a = 0; a < U; ++a) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb[a] + 16 * rhs[a])));
      for (int j = 0; j < MB; ++j) {
        const __m256 f = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[(m0 + j) * S + s]));
        acc[a][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[a][j]), f, acc[a][j]);
      }
    }
  }
  for (int a = 0; a < U; ++a)
    for (int j = 0; j < MB; ++j) _mm256_storeu_ps(out[a / H][j] + 8 * rhs[a], acc[a][j]);
}

// ------------------------------------------------------------ AVX2, many activation rows a tile
// A group's codes of half rh (8 rows) are unpacked into registers once and every activation row of the
// block runs over them, its sums waiting in small arrays in L1: unpacking and the scales cost once per
// up to kWideRows rows instead of once per 4, and a row's work is the maddubs chain alone (2 maddubs and
// ~2 adds per 64 products), where the 4-row blocks above also unpacked, spilled and looped. `xblk`: the
// block's activations group-major (Problem::xgm, written once a call by qlinear_kquant_q8_2d).

KILN_KQ_AVX2 inline __m256i bcast(const void* b) { return _mm256_set1_epi32(load_i32(b)); }

// step c's two maddubs of a Q4_K / Q5_K group (low and high codes), int16 pair sums
KILN_KQ_AVX2 inline __m256i two_avx2(const __m256i* vl, const __m256i* vh, const int8_t* xg, int c) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(vl[c], bcast(xg + 4 * c)), _mm256_maddubs_epi16(vh[c], bcast(xg + 16 + 4 * c)));
}

template <int F>
KILN_KQ_AVX2 void tile_wide_avx2(const Problem& p, int64_t t, int64_t m0, int mb, const int8_t* xblk, float (*acc)[kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S;
  const __m256i zero = _mm256_setzero_si256();
  alignas(32) int32_t isum[kWideRows][kRows];
  for (int j = 0; j < mb; ++j) {
    _mm256_store_ps(acc[j], _mm256_setzero_ps());
    _mm256_store_ps(acc[j] + 8, _mm256_setzero_ps());
  }
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = p.sc + (t * S + s) * SB;
    const uint8_t* qb = p.qs + (t * S + s) * QS;
    for (int rh = 0; rh < 2; ++rh) {
      if constexpr (F == Q6K) {   // isum starts at -32 * sum_b sc_b * (sum of sub-block b's activations)
        __m256i pr[8];
        for (int q = 0; q < 8; ++q) pr[q] = q6_offset_pair_avx2(sb, q, rh);
        for (int j = 0; j < mb; ++j) {
          const int16_t* b16 = p.b16 + ((m0 + j) * S + s) * 16;
          __m256i o = _mm256_madd_epi16(pr[0], bcast(b16));
          for (int q = 1; q < 8; ++q) o = _mm256_add_epi32(o, _mm256_madd_epi16(pr[q], bcast(b16 + 2 * q)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(isum[j] + 8 * rh), o);
        }
      } else {   // the mins: acc = fma(float(msum), -(dmin * xd), acc)
        __m256i pr[4];
        for (int q = 0; q < 4; ++q) pr[q] = min_pair_avx2(sb, q, rh);
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * rh)));
        for (int j = 0; j < mb; ++j) {
          const int16_t* b32 = p.b32 + ((m0 + j) * S + s) * 8;
          __m256i m = _mm256_madd_epi16(pr[0], bcast(b32));
          for (int q = 1; q < 4; ++q) m = _mm256_add_epi32(m, _mm256_madd_epi16(pr[q], bcast(b32 + 2 * q)));
          const __m256 f = _mm256_mul_ps(dmin, _mm256_set1_ps(p.xd[(m0 + j) * S + s]));
          _mm256_store_ps(acc[j] + 8 * rh, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), f, _mm256_load_ps(acc[j] + 8 * rh)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(isum[j] + 8 * rh), zero);
        }
      }
    }
    for (int g = 0; g < 8; ++g) {
      prefetch_ahead<F>(p.qs, p.sc, S, t, s, g, 1);
      for (int rh = 0; rh < 2; ++rh) {
        if constexpr (F == Q6K) {
          __m256i v[2][4], scv[2];
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            scv[h] = q6_scale_avx2(sb, 2 * g + h, rh);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) v[h][c] = q6_half_avx2(qb + g * QB, c, h, rh);
          }
          for (int j = 0; j < mb; ++j) {
            const int8_t* xg = xblk + ((s * 8 + g) * mb + j) * kGroup;
            __m256i* is = reinterpret_cast<__m256i*>(isum[j] + 8 * rh);
            __m256i sum = _mm256_load_si256(is);
            for (int h = 0; h < 2; ++h)
              for (int c = 0; c < 4; c += 2) {   // two products at most in int16 (2 * 2 * 63 * 127 = 32004)
                const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(v[h][c], bcast(xg + 16 * h + 4 * c)),
                                                     _mm256_maddubs_epi16(v[h][c + 1], bcast(xg + 16 * h + 4 * c + 4)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, scv[h]));
              }
            _mm256_store_si256(is, sum);
          }
        } else {
          __m256i vl[4], vh[4];
          for (int c = 0; c < 4; ++c) codes_avx2<F, false>(qb + g * QB, c, rh, vl[c], vh[c]);
          const __m256i scv = group_scale_avx2(sb, g, rh);
          for (int j = 0; j < mb; ++j) {
            const int8_t* xg = xblk + ((s * 8 + g) * mb + j) * kGroup;
            __m256i* is = reinterpret_cast<__m256i*>(isum[j] + 8 * rh);
            __m256i sum;
            if constexpr (F == Q4K) {   // 8 products in int16 (8 * 2 * 15 * 127 = 30480)
              const __m256i p16 = _mm256_add_epi16(_mm256_add_epi16(two_avx2(vl, vh, xg, 0), two_avx2(vl, vh, xg, 1)), _mm256_add_epi16(two_avx2(vl, vh, xg, 2), two_avx2(vl, vh, xg, 3)));
              sum = _mm256_add_epi32(_mm256_load_si256(is), _mm256_madd_epi16(p16, scv));
            } else {   // Q5_K: 4 (4 * 2 * 31 * 127 = 31496)
              sum = _mm256_add_epi32(_mm256_load_si256(is),
                                     _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(two_avx2(vl, vh, xg, 0), two_avx2(vl, vh, xg, 1)), scv),
                                                      _mm256_madd_epi16(_mm256_add_epi16(two_avx2(vl, vh, xg, 2), two_avx2(vl, vh, xg, 3)), scv)));
            }
            _mm256_store_si256(is, sum);
          }
        }
      }
    }
    for (int rh = 0; rh < 2; ++rh) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * rh)));
      for (int j = 0; j < mb; ++j) {
        const __m256 f = _mm256_mul_ps(d, _mm256_set1_ps(p.xd[(m0 + j) * S + s]));
        const __m256 is = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(isum[j] + 8 * rh)));
        _mm256_store_ps(acc[j] + 8 * rh, _mm256_fmadd_ps(is, f, _mm256_load_ps(acc[j] + 8 * rh)));
      }
    }
  }
}

template <int F>
KILN_KQ_VNNI void rows_vnni(const Problem& p, int64_t t, int64_t m0, int mb, float (*out)[kMaxMB][kRows]) {
  switch (mb) {
    case 1: return tiles_vnni<F, 1, 1>(p, t, m0, out);
    case 2: return tiles_vnni<F, 1, 2>(p, t, m0, out);
    case 3: return tiles_vnni<F, 1, 3>(p, t, m0, out);
    case 4: return tiles_vnni<F, 1, 4>(p, t, m0, out);
    case 5: return tiles_vnni<F, 1, 5>(p, t, m0, out);
    case 6: return tiles_vnni<F, 1, 6>(p, t, m0, out);
    case 7: return tiles_vnni<F, 1, 7>(p, t, m0, out);
    default: return tiles_vnni<F, 1, 8>(p, t, m0, out);
  }
}

template <int F>
KILN_KQ_AVX2 void rows_avx2(const Problem& p, int64_t t, int64_t m0, int mb, int rh, float (*out)[kMaxMB][kRows]) {
  switch (mb) {
    case 1: return tiles_avx2<F, 1, 1, 1>(p, t, m0, rh, out);
    case 2: return tiles_avx2<F, 1, 2, 1>(p, t, m0, rh, out);
    case 3: return tiles_avx2<F, 1, 3, 1>(p, t, m0, rh, out);
    default: return tiles_avx2<F, 1, 4, 1>(p, t, m0, rh, out);
  }
}

// Tiles [t0, t1) for every activation row, in blocks of up to 8 rows (AVX2: 4): more rows share each
// code vector; one or two rows may read several tiles side by side.
template <int F>
void run_x86(const Problem& p, int64_t t0, int64_t t1, bool vnni) {
  float out[4][kMaxMB][kRows];
  const int64_t block = vnni ? kMaxMB : kMaxMBAvx2;
  if (p.xgm) {   // AVX2, kWideMinRows rows or more: every tile with up to kWideRows rows at once
    alignas(32) float acc[kWideRows][kRows];
    for (int64_t m0 = 0; m0 < p.M; m0 += kWideRows) {
      const int mb = static_cast<int>(std::min<int64_t>(kWideRows, p.M - m0));
      for (int64_t t = t0; t < t1; ++t) {
        tile_wide_avx2<F>(p, t, m0, mb, p.xgm + m0 * p.S * kSuper, acc);
        for (int j = 0; j < mb; ++j) store(p, m0 + j, t, acc[j]);
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += block) {
    const int mb = static_cast<int>(std::min<int64_t>(block, p.M - m0));
    // One or two rows read long tiles side by side (independent chains hide the dot products' latency),
    // short ones one at a time, which streams them from memory faster. Weights past the L3, two cores
    // of a Zen 4: one row, K = 2048 (8 superblocks): one tile 12-27% faster than four, K = 3072 4%,
    // K = 4096 even, K = 8192 four 0-6% faster; two rows, K = 2048: one tile 14-20% faster than two,
    // K = 3072-8192 two 7-25% faster. AVX2, one row of Q6_K (the K-quant whose codes take the most
    // instructions a byte to unpack): three tiles side by side from K = 3072, one thread 10-45% more
    // GB/s (K = 3072 10-19%, 4096 23-37%, 8192 and 14336 30-45%), two threads 8-30%; at K = 2048 three
    // tiles were even to 16% slower, and Q4_K two tiles 6-25% slower at every K. AVX512-VNNI, one row of
    // Q6_K: four tiles from K = 2048 (K = 2048 even to 18% more GB/s, 3072 10-25%, 4096 8-22%); Q4_K
    // gained nothing there from four below K = 8192.
    const int want = !vnni ? (F == Q6K && mb == 1 && p.S >= 12 ? 3 : 1)
                     : mb == 1 ? (p.S >= (F == Q6K ? 8 : 32) ? 4 : 1) : mb == 2 ? (p.S > 8 ? 2 : 1) : 1;
    for (int64_t t = t0; t < t1;) {
      const int nt = t1 - t >= want ? want : 1;
      if (vnni) {
        if (nt == 4) tiles_vnni<F, 4, 1>(p, t, m0, out);
        else if (nt == 2) tiles_vnni<F, 2, 2>(p, t, m0, out);
        else rows_vnni<F>(p, t, m0, mb, out);
      } else if (nt == 3) {
        tiles_avx2<F, F == Q6K ? 3 : 1, 1, 2>(p, t, m0, 0, out);   // only Q6_K instantiates three tiles
      } else if (mb == 1) {
        tiles_avx2<F, 1, 1, 2>(p, t, m0, 0, out);   // one row: a tile's two halves side by side
      } else {
        for (int rh = 0; rh < 2; ++rh) rows_avx2<F>(p, t, m0, mb, rh, out);
      }
      for (int a = 0; a < nt; ++a)
        for (int j = 0; j < mb; ++j) store(p, m0 + j, t + a, out[a][j]);
      t += nt;
    }
  }
}
#endif

}  // namespace

namespace kiln {

torch::Tensor qlinear_kquant_q8_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                   int64_t fmt, int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                   bool out_float) {
  const int64_t M = x.size(0), K = x.size(1), S = K / kSuper;
  const int f = static_cast<int>(fmt);
  const int64_t T = qs.size(0);
  const int64_t level = resolve_isa(isa, "kiln qlinear_kquant");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({M, n}, x.options().dtype(out_float || !bf16 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;

  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd;
  thread_local std::vector<int16_t> b16, b32;
  xq.resize(static_cast<size_t>(M * K));
  xd.resize(static_cast<size_t>(M * S));
  b16.resize(static_cast<size_t>(M * S * 16));
  b32.resize(static_cast<size_t>(M * S * 8));
  quantize_activation_rows_256(level, x.data_ptr(), bf16, M, K, xq.data(), xd.data(), b16.data(), b32.data());
  const bool vnni = level >= ISA_AVX512 && cpu_has_avx512_vnni();
  // AVX2's many-row kernel reads a block's activations group-major ([group][row][32 bytes], per block of
  // kWideRows rows): at their stride of K a block's rows fell into one or two L1 sets (K = 8192 / 2048)
  // and missed on every pass (+20-30% at 1B's shapes). Copied once a call, for every thread's tiles.
  thread_local std::vector<int8_t> xgm;
  const bool wide = level >= ISA_AVX2 && !vnni && M >= kWideMinRows;
  if (wide) {
    xgm.resize(static_cast<size_t>(M * K));
    for (int64_t m0 = 0; m0 < M; m0 += kWideRows) {
      const int64_t mb = std::min<int64_t>(kWideRows, M - m0);
      int8_t* blk = xgm.data() + m0 * K;
      for (int64_t gi = 0; gi < S * 8; ++gi)
        for (int64_t j = 0; j < mb; ++j) std::memcpy(blk + (gi * mb + j) * kGroup, xq.data() + (m0 + j) * K + gi * kGroup, kGroup);
    }
  }
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln qlinear_kquant: bias must have n elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  const Problem p{fmt, M, n, S, qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), xq.data(), xd.data(), b16.data(),
                  b32.data(), wide ? xgm.data() : nullptr, bias_pad.empty() ? nullptr : bias_pad.data(), y.data_ptr(),
                  y.scalar_type() == torch::kBFloat16};
  const int64_t chunk =
      kquant_call_chunk_tiles(T, S * (super_bytes(f) + scale_bytes(f)), M, vnni ? kMaxMB : kMaxMBAvx2);
  parallel_tasks((T + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t t0 = c * chunk, t1 = std::min(T, t0 + chunk);
#ifdef KILN_KQ_X86
    if (level >= ISA_AVX2) {
      if (f == Q4K) return run_x86<Q4K>(p, t0, t1, vnni);
      if (f == Q5K) return run_x86<Q5K>(p, t0, t1, vnni);
      return run_x86<Q6K>(p, t0, t1, vnni);
    }
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; ++m) tile_scalar(p, t, m);
  });
  return y;
}

}  // namespace kiln
