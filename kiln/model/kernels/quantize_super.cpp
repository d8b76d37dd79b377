// Activations quantized per superblock of 256 for the K-quant kernels (qlinear_kquant_q8.cpp), as
// llama.cpp's Q8_K quantizes them: one scale for 256 values, so a K-quant superblock's 6- and 8-bit
// sub-block scales multiply exact integer dot products and only one float factor remains a superblock.
// The int8 sums of every 16 and every 32 values come with it (the mins of Q4_K / Q5_K and Q6_K's -32
// offset multiply them).
//
// Per superblock: amax = max |x| (0 below 1e-30, as the per-32 quantizer in qlinear.cpp), id = 127 / amax,
// q = round-half-even(x * id), d = amax / 127. The scalar, AVX2 and AVX-512 code give the same bytes.

#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_QS_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kSuper = 256;
constexpr float kTinyAmax = 1e-30f;   // the per-32 quantizer's threshold (qlinear.cpp)

inline float load_x(const void* x, bool bf16, int64_t i) {
  return bf16 ? kiln::bf16_bits_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline float inverse_scale(float& amax) {
  if (!(amax >= kTinyAmax)) amax = 0.0f;
  return amax > 0.0f ? 127.0f / amax : 0.0f;
}

void quantize_scalar(const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd, int16_t* b16,
                     int16_t* b32) {
  const int64_t S = K / kSuper;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t base = m * K + s * kSuper;
      float amax = 0.0f;
      for (int i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(load_x(x, bf16, base + i)));
      const float id = inverse_scale(amax);
      int8_t* q = xq + base;
      for (int i = 0; i < kSuper; ++i) q[i] = static_cast<int8_t>(std::nearbyint(load_x(x, bf16, base + i) * id));
      xd[m * S + s] = amax / 127.0f;
      for (int b = 0; b < 16; ++b) {
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * b + i];
        b16[(m * S + s) * 16 + b] = static_cast<int16_t>(sum);
      }
      for (int g = 0; g < 8; ++g)
        b32[(m * S + s) * 8 + g] = static_cast<int16_t>(b16[(m * S + s) * 16 + 2 * g] + b16[(m * S + s) * 16 + 2 * g + 1]);
    }
}

#ifdef KILN_QS_X86
#define KILN_QS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define KILN_QS_AVX2 __attribute__((target("avx2,fma,f16c")))

KILN_QS_AVX512 void quantize_avx512(const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                                    int16_t* b16, int16_t* b32) {
  const int64_t S = K / kSuper;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t base = m * K + s * kSuper;
      __m512 v[16];
      __m512 mx = _mm512_setzero_ps();
      for (int c = 0; c < 16; ++c) {
        if (bf16) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + base + 16 * c));
          v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else {
          v[c] = _mm512_loadu_ps(static_cast<const float*>(x) + base + 16 * c);
        }
        mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, v[c]));
      }
      float amax = _mm512_reduce_max_ps(mx);
      const __m512 id = _mm512_set1_ps(inverse_scale(amax));
      int16_t* sums = b16 + (m * S + s) * 16;
      for (int c = 0; c < 16; ++c) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], id));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + base + 16 * c), _mm512_cvtsepi32_epi8(q));
        sums[c] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
      }
      xd[m * S + s] = amax / 127.0f;
      for (int g = 0; g < 8; ++g) b32[(m * S + s) * 8 + g] = static_cast<int16_t>(sums[2 * g] + sums[2 * g + 1]);
    }
}

KILN_QS_AVX2 void quantize_avx2(const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                                int16_t* b16, int16_t* b32) {
  const int64_t S = K / kSuper;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t base = m * K + s * kSuper;
      __m256 v[32];
      __m256 mx = _mm256_setzero_ps();
      for (int c = 0; c < 32; ++c) {
        if (bf16) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + base + 8 * c));
          v[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        } else {
          v[c] = _mm256_loadu_ps(static_cast<const float*>(x) + base + 8 * c);
        }
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[c]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const __m256 id = _mm256_set1_ps(inverse_scale(amax));
      int16_t* sums = b16 + (m * S + s) * 16;
      for (int c = 0; c < 32; c += 4) {   // 32 values: 4 vectors of 8
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c + i], id));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + base + 8 * c), _mm256_permutevar8x32_epi32(packed, order));
        for (int h = 0; h < 2; ++h) {
          const __m256i s8 = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
          __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
          s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
          sums[c / 2 + h] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1))));
        }
      }
      xd[m * S + s] = amax / 127.0f;
      for (int g = 0; g < 8; ++g) b32[(m * S + s) * 8 + g] = static_cast<int16_t>(sums[2 * g] + sums[2 * g + 1]);
    }
}
#endif

void quantize(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd, int16_t* b16,
              int16_t* b32) {
#ifdef KILN_QS_X86
  if (isa >= kiln::ISA_AVX512) return quantize_avx512(x, bf16, M, K, xq, xd, b16, b32);
  if (isa == kiln::ISA_AVX2) return quantize_avx2(x, bf16, M, K, xq, xd, b16, b32);
#endif
  quantize_scalar(x, bf16, M, K, xq, xd, b16, b32);
}

}  // namespace

namespace kiln {

void quantize_activation_rows_256(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                                  int16_t* b16, int16_t* b32) {
  // rows shared out on the pool in chunks of ~8K values: each row is quantized on its own, so the
  // bytes do not depend on the split
  const int64_t rows = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, K)), S = K / kSuper;
  const char* xb = static_cast<const char*>(x);
  parallel_tasks((M + rows - 1) / rows, [&](int64_t c) {
    const int64_t m0 = c * rows, mb = std::min(rows, M - m0);
    quantize(isa, xb + m0 * K * (bf16 ? 2 : 4), bf16, mb, K, xq + m0 * K, xd + m0 * S, b16 + m0 * S * 16,
             b32 + m0 * S * 8);
  });
}

}  // namespace kiln
