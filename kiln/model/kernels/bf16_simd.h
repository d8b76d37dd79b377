// bfloat16 <-> float32 in AVX2 / AVX-512 registers, rounding as c10::BFloat16 does (nearest even,
// NaN -> 0x7FC0): the vector twin of qlinear.h's float_to_bf16_bits, shared by the kernels that
// round per element (silu_mul, rms_norm, attention outputs, LoRA adds).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace kiln {

// 8 bfloat16 values widened to float32 (exact: a 16-bit shift)
__attribute__((target("avx2"))) inline __m256 bf16x8_to_float(const void* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// each lane's float rounded to bfloat16, its 16 bits in the low half of the lane
__attribute__((target("avx2"))) inline __m256i bf16_bits8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// each lane's float rounded to bfloat16 and widened back: the value a bfloat16 store would keep
__attribute__((target("avx2"))) inline __m256 round_to_bf16x8(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}

// 8 lanes of bf16_bits8 stored as 8 consecutive bfloat16 values
__attribute__((target("avx2"))) inline void store_bf16_bits8(void* p, __m256i bits) {
  _mm_storeu_si128(static_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// the AVX-512 twin of bf16_bits8
__attribute__((target("avx512f"))) inline __m512i bf16_bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

}  // namespace kiln
#endif
