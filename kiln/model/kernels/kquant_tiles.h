// The tiled K-quant weights' bytes (kiln/model/kquant.py builds them; qlinear_kquant.cpp documents the
// layout), read by both products: float activations (qlinear_kquant.cpp) and 8-bit ones
// (qlinear_kquant_q8.cpp). Format constants, the scalar readers of a code and of a scale, and the SIMD
// unpacking of a tile's scale factors and codes.
#pragma once

#include "qlinear.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_KQ_X86 1
#include <immintrin.h>
#endif

namespace kiln {
namespace kq {

enum Fmt : int { Q4K = 0, Q5K = 1, Q6K = 2 };
constexpr int kRows = 16;
constexpr int kGroup = 32;
constexpr int kSuper = 256;
constexpr int64_t kPrefetchBytes = 4096;

constexpr int64_t group_bytes(int f) { return f == Q4K ? 256 : f == Q5K ? 320 : 384; }
constexpr int64_t super_bytes(int f) { return 8 * group_bytes(f); }
constexpr int64_t scale_bytes(int f) { return f == Q6K ? 288 : 256; }

inline uint16_t load_u16(const uint8_t* b) {
  uint16_t v;
  std::memcpy(&v, b, 2);
  return v;
}

// Code kk (0..31) of group qg's row r as stored: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 (its value is code - 32).
inline int code_unsigned(int f, const uint8_t* qg, int r, int kk) {
  const int h = kk / 16, c = (kk % 16) / 4, i = kk % 4;
  const uint8_t b = qg[c * 64 + r * 4 + i];
  int q = h ? b >> 4 : b & 0x0F;
  if (f == Q5K) q |= ((qg[256 + r * 4 + i] >> (4 * h + c)) & 1) << 4;
  if (f == Q6K) q |= ((qg[256 + h * 64 + r * 4 + i] >> (2 * c)) & 3) << 4;
  return q;
}

// Code kk of group qg's row r as the float the float-activation kernels multiply with (Q6_K: code - 32).
inline float code_scalar(int f, const uint8_t* qg, int r, int kk) {
  return static_cast<float>(code_unsigned(f, qg, r, kk) - (f == Q6K ? 32 : 0));
}

// Row r's 6-bit scale and min of group j (GGUF's get_scale_min_k4).
inline void scale_min_scalar(const uint8_t* sb, int r, int j, int& sc, int& m) {
  auto B = [&](int b) { return static_cast<int>(sb[64 + b * 16 + r]); };
  if (j < 4) {
    sc = B(j) & 63;
    m = B(j + 4) & 63;
  } else {
    sc = (B(j + 4) & 0x0F) | ((B(j - 4) >> 6) << 4);
    m = (B(j + 4) >> 4) | ((B(j) >> 6) << 4);
  }
}

// Bias, dtype conversion and a partial last tile: `acc` holds tile t's 16 outputs for activation row m.
inline void store_tile_row(void* out, bool out_bf16, int64_t N, const float* bias, int64_t m, int64_t t,
                           const float* acc) {
  const int64_t n0 = t * kRows, cnt = N - n0 < kRows ? N - n0 : kRows;
  for (int64_t r = 0; r < cnt; ++r) {
    const float v = acc[r] + (bias ? bias[n0 + r] : 0.0f);
    if (out_bf16) {
      static_cast<uint16_t*>(out)[m * N + n0 + r] = float_to_bf16_bits(v);
    } else {
      static_cast<float*>(out)[m * N + n0 + r] = v;
    }
  }
}

// Tiles a thread claims at a time: whole groups of 4 (the side-by-side decode's group), enough chunks
// that the threads finish together, small enough (~64 KB) that a row block's re-reads hit L2.
inline int64_t kquant_chunk_tiles(int64_t T, int64_t tile_bytes) {
  const int64_t by_size = ((int64_t{64} << 10) / tile_bytes + 3) / 4 * 4, by_count = (T / 16 + 3) / 4 * 4;
  return by_size < by_count ? (by_size > 4 ? by_size : 4) : (by_count > 4 ? by_count : 4);
}

// The chunk of a call with M activation rows whose kernel serves up to `block` rows a pass: rows that fit
// one block read every tile once, in long runs (kiln::stream_chunk_tiles); more re-read each chunk from L2.
inline int64_t kquant_call_chunk_tiles(int64_t T, int64_t tile_bytes, int64_t M, int64_t block) {
  const int64_t small = kquant_chunk_tiles(T, tile_bytes);
  return M <= block ? kiln::stream_chunk_tiles(T, at::get_num_threads(), 4, small) : small;
}

#ifdef KILN_KQ_X86
#define KILN_KQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KILN_KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// Prefetch the codes kPrefetchBytes past group j of superblock s of tile t (past the tile's end, in
// tile t + nt, the one a pass over nt tiles side by side reads next), and at group 0 the scales of the
// superblock two ahead.
template <int F>
inline void prefetch_ahead(const uint8_t* qs, const uint8_t* sc, int64_t S, int64_t t, int64_t s, int j, int nt) {
  constexpr int64_t QB = group_bytes(F), SB = scale_bytes(F);
  const int64_t at = kiln::group_ahead(t, s * 8 + j, S * 8, kPrefetchBytes / QB, nt);
  for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qs + at * QB + b), _MM_HINT_T0);
  if (j == 0) {
    const int64_t sa = kiln::group_ahead(t, s, S, 2, nt);
    for (int64_t b = 0; b < SB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(sc + sa * SB + b), _MM_HINT_T0);
  }
}

// The 6-bit scales (sc) and mins (m) of group j for the rows whose bytes `B` holds (16 or 8 rows: byte b
// of every row, GGUF's get_scale_min_k4 per byte).
KILN_KQ_AVX2 inline void scale_min_bytes(const __m128i* B, int j, __m128i& sc, __m128i& m) {
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3);
  if (j < 4) {
    sc = _mm_and_si128(B[j], m63);
    m = _mm_and_si128(B[j + 4], m63);
  } else {
    const __m128i top_lo = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[j - 4], 6), m3), 4);
    const __m128i top_hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[j], 6), m3), 4);
    sc = _mm_or_si128(_mm_and_si128(B[j + 4], m15), top_lo);
    m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(B[j + 4], 4), m15), top_hi);
  }
}

// ------------------------------------------------------------ AVX-512: a tile's 16 rows in one vector

// Group j's scale factors for the 16 rows: Q4_K / Q5_K d*sc in f0[j], -(dmin*m) in f1[j]; Q6_K d*sc of
// the two halves in f0[j], f1[j].
template <int F>
KILN_KQ_AVX512 inline void scales_avx512(const uint8_t* sb, __m512* f0, __m512* f1) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
  if (F == Q6K) {
    for (int j = 0; j < 8; ++j) {
      const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j) * 16));
      const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j + 1) * 16));
      f0[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0)));
      f1[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1)));
    }
    return;
  }
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  __m128i B[12];
  for (int b = 0; b < 12; ++b) B[b] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 64 + 16 * b));
  for (int j = 0; j < 8; ++j) {
    __m128i sc, m;
    scale_min_bytes(B, j, sc, m);
    f0[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m)));
    f1[j] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), sign));   // exact negation
  }
}

// The codes of K indices 4c+i (lo, byte i of each row's dword) and 16+4c+i (hi) of group qg, 16 rows.
// Q4_K: lo holds both nibbles (extraction shifts); Q5_K: 5-bit codes; Q6_K: code - 32 as signed bytes.
template <int F, bool kSigned6 = true>
KILN_KQ_AVX512 inline void codes_avx512(const uint8_t* qg, int c, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_loadu_si512(qg + c * 64);
  if (F == Q4K) {
    lo = hi = v;
    return;
  }
  const __m512i m15 = _mm512_set1_epi8(15);
  const __m512i nl = _mm512_and_si512(v, m15), nh = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
  if (F == Q5K) {
    const __m512i one = _mm512_set1_epi8(1), hb = _mm512_loadu_si512(qg + 256);
    lo = _mm512_or_si512(nl, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, c), one), 4));
    hi = _mm512_or_si512(nh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 + c), one), 4));
  } else {
    const __m512i three = _mm512_set1_epi8(3), off = _mm512_set1_epi8(32);
    const __m512i h0 = _mm512_loadu_si512(qg + 256), h1 = _mm512_loadu_si512(qg + 320);
    lo = _mm512_or_si512(nl, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h0, 2 * c), three), 4));
    hi = _mm512_or_si512(nh, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h1, 2 * c), three), 4));
    if (kSigned6) {
      lo = _mm512_sub_epi8(lo, off);
      hi = _mm512_sub_epi8(hi, off);
    }
  }
}

template <int F>
KILN_KQ_AVX2 inline void scales_avx2(const uint8_t* sb, int h, __m256* f0, __m256* f1) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
  if (F == Q6K) {
    for (int j = 0; j < 8; ++j) {
      const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j) * 16 + 8 * h));
      const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 32 + (2 * j + 1) * 16 + 8 * h));
      f0[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s0)));
      f1[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s1)));
    }
    return;
  }
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * h)));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  __m128i B[12];
  for (int b = 0; b < 12; ++b) B[b] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 64 + 16 * b + 8 * h));
  for (int j = 0; j < 8; ++j) {
    __m128i sc, m;
    scale_min_bytes(B, j, sc, m);
    f0[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    f1[j] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m))), sign);
  }
}

// Half h's codes at c: Q4_K / Q5_K unsigned bytes, Q6_K code - 32 as signed bytes (byte i of each
// row's dword: K index 4c+i in lo, 16+4c+i in hi).
template <int F, bool kSigned6 = true>
KILN_KQ_AVX2 inline void codes_avx2(const uint8_t* qg, int c, int h, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32 * h));
  const __m256i m15 = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(v, m15);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
  if (F == Q5K) {   // bits c and 4 + c of each byte to bit 4 by one 16-bit shift each (what crosses into
                    // a neighbouring byte lands outside bit 4) and one mask
    const __m256i m16 = _mm256_set1_epi8(16);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 256 + 32 * h));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - c), m16));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(hb, c), m16));
  } else if (F == Q6K) {
    const __m256i three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 256 + 32 * h));
    const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 320 + 32 * h));
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h0, 2 * c), three), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h1, 2 * c), three), 4));
    if (kSigned6) {
      lo = _mm256_sub_epi8(lo, off);
      hi = _mm256_sub_epi8(hi, off);
    }
  }
}
#endif

}  // namespace kq
}  // namespace kiln
