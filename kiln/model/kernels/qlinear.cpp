// Quantized linear layers for small M (decode): y[M, N] = x[M, K] @ W^T (+ bias).
//
// Weights are 4-bit (q4_1: value = d*q + m, q in 0..15) or 8-bit (q8_0: value = d*q) in groups of 32
// along K, repacked into tiles of 16 output rows (see kiln/model/quant.py for the byte layout).
// Activations are quantized once per call to int8 per group of 32 (scale = max|x| / 127), so each
// group of each output row is an integer dot product (AVX512-VNNI vpdpbusd: unsigned weight bytes
// times signed activation bytes), combined with the scales in fp32:
//     y[m, n] = sum_g  dw[n,g] * xd[m,g] * isum  +  mw[n,g] * xd[m,g] * sum(xq[m, group g])
// q8_0 weights are stored offset by +128 (unsigned), which is the q4_1 formula with mw = -128 * dw.
// iq4_nl weights (GGUF IQ4_NL, and IQ4_XS with each group's scale in float16) store q4_1's nibbles, each
// a code into IQ4's table of 16 int8 values: unpacked as q4_1's, looked up (vpshufb), then q8_0's arithmetic.
//
// A tile keeps the 16 rows in the 16 int32 lanes of a zmm register (4 consecutive K elements per
// lane), so one vpdpbusd with a broadcast of 4 activation bytes advances 16 rows at once and the
// per-group scales apply to whole vectors. Several activation rows reuse every unpacked weight
// register, so batched decode reads the weights once.
//
// Three code paths compute bit-identical results (the same integer sums, then the same float
// operations in the same order): AVX512-VNNI, AVX2 (no VNNI: maddubs / madd, q8_0 through |q| and
// sign-adjusted activations) and portable scalar C++. Each SIMD function carries its
// own target attribute, so the library itself is built for the baseline ISA and stays loadable on
// any x86-64 (or other) CPU; the path is picked at run time from cpuid.

#include <torch/extension.h>

#include "bf16_simd.h"
#include "decode_ops.h"
#include "dense_bf16.h"
#include "decode_stack.h"
#include "isa.h"
#include "qlinear.h"
#include "qlinear_float.h"
#include "qlinear_kquant.h"
#include "kquant_pack.h"
#include "lora_bgmv.h"
#include "silu_mul.h"
#include <ATen/Parallel.h>  // at::get_num_threads, at::in_parallel_region

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;      // output rows per tile
constexpr int kGroup = 32;     // K elements per quantization group
constexpr int kMaxMB = 8;      // activation rows sharing one pass over a tile's weights
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the group in use its weights are prefetched
// the AVX2 half-tile passes (blocks of 2+ rows) take about twice as long per byte: their prefetches go
// further ahead (measured on an Intel Xeon, the whole model's GEMVs when one row took them too: 4 KB
// ahead 5.4 ms a pass, 16 KB 4.5 ms; none 6.5 ms). A single row has its own pass (tile_avx2_row).
constexpr int64_t kPrefetchBytesAvx2 = 16384;
constexpr float kTinyAmax = 1e-30f;  // below this a group quantizes to zero (127/amax would overflow)

enum Kind : int64_t { Q4_1 = 0, Q8_0 = 1, IQ4_NL = 2 };
// the int8 value each 4-bit iq4_nl code stands for (llama.cpp's kvalues_iq4nl)
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
using kiln::ISA_AVX2;
using kiln::ISA_SCALAR;
constexpr int64_t ISA_AVX512_VNNI = kiln::ISA_AVX512;  // this file's AVX512 code needs VNNI too

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t qs_group_bytes(int64_t kind) { return kind == Q8_0 ? 512 : 256; }
inline int64_t scale_group_halfs(int64_t kind) { return kind == Q4_1 ? 32 : 16; }


using kiln::bf16_bits_to_float;
using kiln::float_to_bf16_bits;
using kiln::half_bits_to_float;

// What every tile of one call shares.
struct Problem {
  int64_t kind, M, N, G, Kp;
  const uint8_t* qs;        // [T, G, qs_group_bytes]
  const uint16_t* scales;   // [T, G, scale_group_halfs] fp16 bits
  const int8_t* xq;         // [M, Kp]
  const float* xd;          // [M, G] activation scales
  const float* xs;          // [M, G] activation scale * sum of the group's int8 values
  const int32_t* xi;        // [M, G] the sum of the group's int8 values (filled for the AVX2 q8_0 tiles only)
  const float* bias;        // [T * 16] or nullptr
  void* out;                // [M, N]
  bool out_bf16;
};

// Bias, dtype conversion and the partial last tile: `acc` holds 16 rows for one activation row.
inline void store_row_scalar(const Problem& p, int64_t m, int64_t t, const float* acc) {
  const int64_t n0 = t * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.N - n0);
  for (int64_t r = 0; r < cnt; ++r) {
    float v = acc[r] + (p.bias ? p.bias[n0 + r] : 0.0f);
    if (p.out_bf16) {
      static_cast<uint16_t*>(p.out)[m * p.N + n0 + r] = float_to_bf16_bits(v);
    } else {
      static_cast<float*>(p.out)[m * p.N + n0 + r] = v;
    }
  }
}

// ---------------------------------------------------------------- activation quantization

// Per group: amax, id = 127/amax, q = round-half-even(x * id), d = amax/127, s = d * sum(q).
template <typename LoadFn>
inline void quantize_group_scalar(LoadFn load, int64_t valid, int8_t* q, float* d, float* s) {
  float v[kGroup];
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) {
    v[i] = i < valid ? load(i) : 0.0f;
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (!(amax >= kTinyAmax)) amax = 0.0f;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int i = 0; i < kGroup; ++i) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * id));
    q[i] = static_cast<int8_t>(qi);
    sum += qi;
  }
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(sum);
}

void quantize_rows_scalar(const void* x, bool bf16, int64_t M, int64_t K, int64_t G, int8_t* xq,
                          float* xd, float* xs) {
  const int64_t Kp = G * kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = m * K + g * kGroup;
      const int64_t valid = std::min<int64_t>(kGroup, K - g * kGroup);
      int8_t* q = xq + m * Kp + g * kGroup;
      if (bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + base;
        quantize_group_scalar([&](int i) { return bf16_bits_to_float(src[i]); }, valid, q, &xd[m * G + g], &xs[m * G + g]);
      } else {
        const float* src = static_cast<const float*>(x) + base;
        quantize_group_scalar([&](int i) { return src[i]; }, valid, q, &xd[m * G + g], &xs[m * G + g]);
      }
    }
  }
}

// ---------------------------------------------------------------- scalar path

inline int32_t weight_scalar(int64_t kind, const uint8_t* qg, int c, int r, int i) {
  if (kind == Q4_1 || kind == IQ4_NL) {
    const uint8_t b = qg[(c & 3) * 64 + r * 4 + i];
    const int code = c < 4 ? (b & 0x0F) : (b >> 4);
    return kind == Q4_1 ? code : kIq4Values[code] + 128;   // iq4_nl: as q8_0 stores its values
  }
  return qg[c * 64 + r * 4 + i];
}

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  float acc[kMaxMB][kRows] = {};
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* qg = p.qs + (t * p.G + g) * qs_group_bytes(p.kind);
    const uint16_t* sg = p.scales + (t * p.G + g) * scale_group_halfs(p.kind);
    float dw[kRows], mw[kRows];
    for (int r = 0; r < kRows; ++r) {
      dw[r] = half_bits_to_float(sg[r]);
      mw[r] = p.kind == Q4_1 ? half_bits_to_float(sg[kRows + r]) : dw[r] * -128.0f;
    }
    for (int64_t j = 0; j < mb; ++j) {
      const int64_t m = m0 + j;
      const int8_t* xg = p.xq + m * p.Kp + g * kGroup;
      const float xd = p.xd[m * p.G + g], xs = p.xs[m * p.G + g];
      for (int r = 0; r < kRows; ++r) {
        int32_t isum = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) isum += weight_scalar(p.kind, qg, c, r, i) * xg[c * 4 + i];
        float a = std::fma(static_cast<float>(isum), dw[r] * xd, acc[j][r]);
        acc[j][r] = std::fma(mw[r], xs, a);
      }
    }
  }
  for (int64_t j = 0; j < mb; ++j) store_row_scalar(p, m0 + j, t, acc[j]);
}

#ifdef KILN_X86

// ---------------------------------------------------------------- AVX512-VNNI path

#define KILN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

// kIq4Values + 128 as unsigned bytes in every 128-bit lane (vpshufb looks up within lanes)
KILN_AVX512 inline __m512i iq4_table_avx512() {
  alignas(16) uint8_t b[16];
  for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(kIq4Values[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
}

KILN_AVX512 void quantize_rows_avx512(const void* x, bool bf16, int64_t M, int64_t K, int64_t G, int8_t* xq,
                                      float* xd, float* xs) {
  const int64_t Kp = G * kGroup;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = m * K + g * kGroup;
      const int64_t valid = std::min<int64_t>(kGroup, K - g * kGroup);
      const __mmask16 ka = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
      const __mmask16 kb = static_cast<__mmask16>(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
      __m512 a, b;
      if (bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + base;
        a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(ka, src)), 16));
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(kb, src + 16)), 16));
      } else {
        const float* src = static_cast<const float*>(x) + base;
        a = _mm512_maskz_loadu_ps(ka, src);
        b = _mm512_maskz_loadu_ps(kb, src + 16);
      }
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
      if (!(amax >= kTinyAmax)) amax = 0.0f;
      const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
      int8_t* q = xq + m * Kp + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      const float d = amax / 127.0f;
      xd[m * G + g] = d;
      xs[m * G + g] = d * static_cast<float>(sum);
    }
  }
}

KILN_AVX512 inline void store_row_avx512(const Problem& p, int64_t m, int64_t t, __m512 acc) {
  const int64_t n0 = t * kRows;
  const int64_t cnt = std::min<int64_t>(kRows, p.N - n0);
  const __mmask16 k = static_cast<__mmask16>(cnt >= 16 ? 0xFFFF : (1u << cnt) - 1);
  if (p.bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p.bias + n0));
  if (p.out_bf16) {
    const __m512i bits = _mm512_castps_si512(acc);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * p.N + n0, k, _mm512_cvtepi32_epi16(r));
  } else {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * p.N + n0, k, acc);
  }
}

template <int64_t KIND, int MB>
KILN_AVX512 void tile_avx512(const Problem& p, int64_t t, int64_t m0) {
  constexpr int64_t QB = KIND == Q8_0 ? 512 : 256;
  constexpr int64_t SB = KIND == Q4_1 ? 32 : 16;
  const uint8_t* qs = p.qs + t * p.G * QB;
  const uint16_t* sc = p.scales + t * p.G * SB;
  const int8_t* xq = p.xq + m0 * p.Kp;
  const float* xd = p.xd + m0 * p.G;
  const float* xs = p.xs + m0 * p.G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* qg = qs + g * QB;
    const uint16_t* sg = sc + g * SB;
    // The hardware prefetcher loses the stream at every tile a thread claims; the weights come from
    // DRAM in a decode step (a model is larger than the caches), so ask for them well ahead. A
    // prefetch past the end of the array is harmless.
    for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + kPrefetchBytes + b), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sg + kPrefetchBytes * SB / QB), _MM_HINT_T0);
    __m512i w[8];
    __m512 dw, mw;
    dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg)));
    if constexpr (KIND == Q4_1) {
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + 16)));
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qg + c * 64);
        w[c] = _mm512_and_si512(v, low4);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    } else if constexpr (KIND == IQ4_NL) {   // each nibble looked up: the value + 128, as q8_0 stores it
      mw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
      const __m512i table = iq4_table_avx512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qg + c * 64);
        w[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
        w[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
      }
    } else {
      mw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f));
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(qg + c * 64);
    }
    for (int j = 0; j < MB; ++j) {
      const int8_t* xg = xq + j * p.Kp + g * kGroup;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        s0 = kiln::dpbusd_bcast(s0, w[c], xg + c * 4);
        s1 = kiln::dpbusd_bcast(s1, w[c + 1], xg + c * 4 + 4);
      }
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      const __m512 a = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(xd[j * p.G + g])), acc[j]);
      acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[j * p.G + g]), a);
    }
  }
  for (int j = 0; j < MB; ++j) store_row_avx512(p, m0 + j, t, acc[j]);
}

template <int64_t KIND>
void tile_avx512_any(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  switch (mb) {
    case 1: return tile_avx512<KIND, 1>(p, t, m0);
    case 2: return tile_avx512<KIND, 2>(p, t, m0);
    case 3: return tile_avx512<KIND, 3>(p, t, m0);
    case 4: return tile_avx512<KIND, 4>(p, t, m0);
    case 5: return tile_avx512<KIND, 5>(p, t, m0);
    case 6: return tile_avx512<KIND, 6>(p, t, m0);
    case 7: return tile_avx512<KIND, 7>(p, t, m0);
    default: return tile_avx512<KIND, 8>(p, t, m0);
  }
}

// ---------------------------------------------------------------- AVX2 path (no VNNI)

#define KILN_AVX2 __attribute__((target("avx2,fma,f16c")))

// quantize_rows_scalar on AVX2: the same amax, scale, round-half-even (MXCSR's default) and sums.
KILN_AVX2 void quantize_rows_avx2(const void* x, bool bf16, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xd,
                                  float* xs, int32_t* xi) {
  const int64_t Kp = G * kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = m * K + g * kGroup;
      const int64_t valid = std::min<int64_t>(kGroup, K - g * kGroup);
      float buf[kGroup];
      __m256 v[4];
      if (valid < kGroup) {   // a partial last group: zeros past K, as the scalar code reads it
        for (int i = 0; i < kGroup; ++i)
          buf[i] = i >= valid ? 0.0f
                   : bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(x)[base + i])
                          : static_cast<const float*>(x)[base + i];
        for (int c = 0; c < 4; ++c) v[c] = _mm256_loadu_ps(buf + 8 * c);
      } else if (bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(x) + base;
        for (int c = 0; c < 4; ++c) {
          const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * c)));
          v[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        }
      } else {
        const float* src = static_cast<const float*>(x) + base;
        for (int c = 0; c < 4; ++c) v[c] = _mm256_loadu_ps(src + 8 * c);
      }
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      if (!(amax >= kTinyAmax)) amax = 0.0f;
      const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i q[4];
      for (int c = 0; c < 4; ++c) q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], id));
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * Kp + g * kGroup),
                          _mm256_permutevar8x32_epi32(packed, order));
      const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      const float d = amax / 127.0f;
      xd[m * G + g] = d;
      xs[m * G + g] = d * static_cast<float>(sum);
      if (xi) xi[m * G + g] = sum;
    }
  }
}

// store_row_scalar's values from registers: bias, then bfloat16 rounding or float32, 16 rows at once
// (the scalar loop took about 3% of a 64-row step's samples); a partial last tile stays scalar.
KILN_AVX2 inline void store_row_avx2(const Problem& p, int64_t m, int64_t t, const float* acc) {
  const int64_t n0 = t * kRows;
  if (p.N - n0 < kRows) return store_row_scalar(p, m, t, acc);
  __m256 lo = _mm256_loadu_ps(acc), hi = _mm256_loadu_ps(acc + 8);
  if (p.bias) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(p.bias + n0));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(p.bias + n0 + 8));
  }
  if (p.out_bf16) {
    uint16_t* o = static_cast<uint16_t*>(p.out) + m * p.N + n0;
    kiln::store_bf16_bits8(o, kiln::bf16_bits8(lo));
    kiln::store_bf16_bits8(o + 8, kiln::bf16_bits8(hi));
  } else {
    float* o = static_cast<float*>(p.out) + m * p.N + n0;
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
  }
}

// kIq4Values as signed bytes in both 128-bit lanes
KILN_AVX2 inline __m256i iq4_table_avx2() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
}

// iq4_nl's signed values at column c (0..7) of a group's bytes qg: c < 4 the low nibbles of block c, else
// the high nibbles of block c - 4 (q4_1's layout), each looked up
KILN_AVX2 inline __m256i iq4_values_avx2(const uint8_t* qg, int c, __m256i table) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + (c & 3) * 64));
  const __m256i nib = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  return _mm256_shuffle_epi8(table, nib);
}

KILN_AVX2 inline __m256i bcast4_avx2(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The integer sums of one group for 8 output rows and MB activation rows (int32 lanes = rows).
template <int64_t KIND, int MB>
KILN_AVX2 inline void group_sums_avx2(const Problem& p, const uint8_t* qg, int64_t m0, int64_t g, __m256i* sums) {
  __m256i w[8];
  [[maybe_unused]] alignas(32) int8_t qsign[KIND == Q4_1 ? 1 : 8][32];   // q8_0, iq4_nl: the signed weights
  if constexpr (KIND == Q4_1) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64));
      w[c] = _mm256_and_si256(v, low4);
      w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
  } else {
    // The stored bytes are q + 128; u8 * s8 pair sums of those overflow maddubs' int16. Instead
    // w = |q| (at most 128) times x with q's sign (|x| <= 127): a pair is at most 32512, exact.
    // sum((q + 128) x) = sum(q x) + 128 sum(x): the same integer as before, so the same bits.
    // iq4_nl: the looked-up values, at most 127 in magnitude
    [[maybe_unused]] const __m256i table = iq4_table_avx2();
    for (int c = 0; c < 8; ++c) {
      const __m256i q = KIND == IQ4_NL ? iq4_values_avx2(qg, c, table)
                                       : _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64)),
                                                          _mm256_set1_epi8(static_cast<char>(0x80)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(qsign[c]), q);
      w[c] = _mm256_abs_epi8(q);
    }
  }
  for (int j = 0; j < MB; ++j) {
    const int64_t m = m0 + j;
    const int8_t* xg = p.xq + m * p.Kp + g * kGroup;
    if constexpr (KIND == Q4_1) {
      // a pair of nibble * int8 products is at most 2 * 15 * 127 = 3810 in magnitude (activations
      // are quantized to +-127), so the group's 8 pair sums per int16 lane (30480) cannot
      // overflow: add them as int16, widen once. The same integers as summing in int32.
      __m256i p0 = _mm256_maddubs_epi16(w[0], bcast4_avx2(xg));
      __m256i p1 = _mm256_maddubs_epi16(w[1], bcast4_avx2(xg + 4));
      for (int c = 2; c < 8; c += 2) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[c], bcast4_avx2(xg + c * 4)));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[c + 1], bcast4_avx2(xg + c * 4 + 4)));
      }
      sums[j] = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
    } else {
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i s0 = _mm256_set1_epi32(128 * p.xi[m * p.G + g]), s1 = _mm256_setzero_si256();
      for (int c = 0; c < 8; c += 2) {
        const __m256i x0 = _mm256_sign_epi8(bcast4_avx2(xg + c * 4),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(qsign[c])));
        const __m256i x1 = _mm256_sign_epi8(bcast4_avx2(xg + c * 4 + 4),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(qsign[c + 1])));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(w[c], x0), ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(w[c + 1], x1), ones));
      }
      sums[j] = _mm256_add_epi32(s0, s1);
    }
  }
}

// The float pass of group g for half h of a tile: acc[j] = fma(mw, xs, fma(isum, dw * xd, acc[j])) for
// MB activation rows, whose integer sums stand `STRIDE` vectors apart; the operations and order
// every path uses, so the same bits.
template <int64_t KIND, int MB, int STRIDE>
KILN_AVX2 inline void scale_group_avx2(const Problem& p, int64_t t, int64_t m0, int64_t g, int h, const __m256i* sums,
                                       __m256* acc) {
  constexpr int64_t SB = KIND == Q4_1 ? 32 : 16;
  const uint16_t* sg = p.scales + (t * p.G + g) * SB + 8 * h;
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));
  const __m256 mw = KIND == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16)))
                                 : _mm256_mul_ps(dw, _mm256_set1_ps(-128.0f));
  for (int j = 0; j < MB; ++j) {
    const int64_t m = m0 + j;
    const __m256 isum = _mm256_cvtepi32_ps(sums[j * STRIDE]);
    const __m256 a = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw, _mm256_set1_ps(p.xd[m * p.G + g])), acc[j]);
    acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(p.xs[m * p.G + g]), a);
  }
}

// Rows 8h .. 8h+7 of a tile (bytes 32h .. 32h+31 of every 64-byte block) for 2 or 3 activation rows,
// group by group: so few rows keep their sums and accumulators in registers.
template <int64_t KIND, int MB>
KILN_AVX2 void half_tile_avx2(const Problem& p, int64_t t, int64_t m0, int h, float (*out)[kRows]) {
  constexpr int64_t QB = KIND == Q8_0 ? 512 : 256;
  constexpr int64_t SB = KIND == Q4_1 ? 32 : 16;
  __m256 acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* qg = p.qs + (t * p.G + g) * QB;
    if (h == 0) {   // as tile_avx512 does: the first half's pass asks for the weights well ahead
      for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + kPrefetchBytesAvx2 + b), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.scales + (t * p.G + g) * SB + kPrefetchBytesAvx2 * SB / QB),
                   _MM_HINT_T0);
    }
    __m256i sums[MB];
    group_sums_avx2<KIND, MB>(p, qg + 32 * h, m0, g, sums);
    scale_group_avx2<KIND, MB, 1>(p, t, m0, g, h, sums, acc);
  }
  for (int j = 0; j < MB; ++j) _mm256_storeu_ps(out[j] + 8 * h, acc[j]);
}

// 4 to 8 activation rows: the integer sums of a group for all 16 rows of the tile, up to kQuad
// activation rows at a time, so each activation broadcast serves both halves of the tile (the
// half-tile passes made every broadcast twice, and q8_0's unpacked each column per half). The same
// integers go through half_tile_avx2's float operations in the same order, so the same bits.
// Measured on a 2-core Zen 2 EPYC, 2 threads: the embedded model's q4_1 layers 10.0 -> 9.2 ms at 8
// rows, 63.4 -> 56-58 ms at 64 (116-121 GMAC/s); its q8_0 LM head 3.8 -> 3.3 ms at 8 rows, 24.8 ->
// 23.7 ms at 64. In a standalone probe of the tiles 2 rows at a time ran 1% slower than 3, and 4
// spilled the accumulators to the stack (6% slower).
constexpr int kQuad = 3;

template <int Q>
KILN_AVX2 inline void group_sums_q4_1_rows(const Problem& p, const uint8_t* qg, int64_t m0, int64_t g,
                                           __m256i (*sums)[2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int8_t* xg[Q];
  for (int j = 0; j < Q; ++j) xg[j] = p.xq + (m0 + j) * p.Kp + g * kGroup;
  // nibble products of one group: at most 8 pair sums of 3810 per int16 lane (see group_sums_avx2)
  __m256i a[Q][2];
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i w0 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64)), low4);
    const __m256i w1 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32)), low4);
    for (int j = 0; j < Q; ++j) {
      const __m256i b = bcast4_avx2(xg[j] + c * 4);
      const __m256i t0 = _mm256_maddubs_epi16(w0, b), t1 = _mm256_maddubs_epi16(w1, b);
      a[j][0] = c == 0 ? t0 : _mm256_add_epi16(a[j][0], t0);
      a[j][1] = c == 0 ? t1 : _mm256_add_epi16(a[j][1], t1);
    }
    // the high nibbles from a second load of the same bytes, which GCC may not merge with the first
    const uint8_t* qh = qg;
    __asm__("" : "+r"(qh));
    const __m256i u0 = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + c * 64)), 4), low4);
    const __m256i u1 = _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + c * 64 + 32)), 4), low4);
    for (int j = 0; j < Q; ++j) {
      const __m256i b = bcast4_avx2(xg[j] + c * 4 + 16);
      a[j][0] = _mm256_add_epi16(a[j][0], _mm256_maddubs_epi16(u0, b));
      a[j][1] = _mm256_add_epi16(a[j][1], _mm256_maddubs_epi16(u1, b));
    }
    // GCC otherwise hoists every product of the group ahead of its adds and spills them all
    for (int j = 0; j < Q; ++j) __asm__("" : "+x"(a[j][0]), "+x"(a[j][1]));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int j = 0; j < Q; ++j) {
    sums[j][0] = _mm256_madd_epi16(a[j][0], ones);
    sums[j][1] = _mm256_madd_epi16(a[j][1], ones);
  }
}

// q8_0's (IQ4: iq4_nl's looked-up values') sums for Q activation rows (group_sums_avx2's |q| and sign
// trick), both halves per broadcast.
template <int Q, bool IQ4 = false>
KILN_AVX2 inline void group_sums_q8_0_rows(const Problem& p, const uint8_t* qg, int64_t m0, int64_t g,
                                           __m256i (*sums)[2]) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  [[maybe_unused]] const __m256i table = iq4_table_avx2();
  const int8_t* xg[Q];
  __m256i s[Q][2];
  for (int j = 0; j < Q; ++j) {
    xg[j] = p.xq + (m0 + j) * p.Kp + g * kGroup;
    s[j][0] = s[j][1] = _mm256_set1_epi32(128 * p.xi[(m0 + j) * p.G + g]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m256i q0 = IQ4 ? iq4_values_avx2(qg, c, table)
                           : _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64)), flip);
    const __m256i q1 = IQ4 ? iq4_values_avx2(qg + 32, c, table)
                           : _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 64 + 32)), flip);
    const __m256i w0 = _mm256_abs_epi8(q0), w1 = _mm256_abs_epi8(q1);
    for (int j = 0; j < Q; ++j) {
      const __m256i b = bcast4_avx2(xg[j] + c * 4);
      s[j][0] = _mm256_add_epi32(s[j][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(b, q0)), ones));
      s[j][1] = _mm256_add_epi32(s[j][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(b, q1)), ones));
    }
    for (int j = 0; j < Q; ++j) __asm__("" : "+x"(s[j][0]), "+x"(s[j][1]));
  }
  for (int j = 0; j < Q; ++j) {
    sums[j][0] = s[j][0];
    sums[j][1] = s[j][1];
  }
}

template <int64_t KIND, int MB, int J0 = 0>
KILN_AVX2 inline void group_sums_quads(const Problem& p, const uint8_t* qg, int64_t m0, int64_t g, __m256i (*sums)[2]) {
  if constexpr (J0 < MB) {
    constexpr int Q = MB - J0 < kQuad ? MB - J0 : kQuad;
    if constexpr (KIND == Q4_1) {
      group_sums_q4_1_rows<Q>(p, qg, m0 + J0, g, sums + J0);
    } else {
      group_sums_q8_0_rows<Q, KIND == IQ4_NL>(p, qg, m0 + J0, g, sums + J0);
    }
    group_sums_quads<KIND, MB, J0 + Q>(p, qg, m0, g, sums);
  }
}

// A tile for 4-8 activation rows. A run of up to kRunGroups groups goes in two passes: the integer dot
// products of every (row, group) into a small buffer, then each half's scales into the accumulators,
// group by group in order (the same operations in the same order as one pass). Split so, the integer
// pass carries no dependency from one group to the next and needs few registers, and the float pass
// keeps MB accumulators in registers: one pass with both spilled the accumulators and waited on their
// store-to-load round trip every group.
constexpr int64_t kRunGroups = 16;

template <int64_t KIND, int MB>
KILN_AVX2 void tile_rows_avx2(const Problem& p, int64_t t, int64_t m0, float (*out)[kRows]) {
  constexpr int64_t QB = KIND == Q8_0 ? 512 : 256;
  constexpr int64_t SB = KIND == Q4_1 ? 32 : 16;
  __m256i sums[kRunGroups][MB][2];
  __m256 acc[2][MB];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < MB; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < p.G; g0 += kRunGroups) {
    const int64_t gn = std::min<int64_t>(kRunGroups, p.G - g0);
    for (int64_t i = 0; i < gn; ++i) {
      const uint8_t* qg = p.qs + (t * p.G + g0 + i) * QB;
      for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + kPrefetchBytesAvx2 + b), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.scales + (t * p.G + g0 + i) * SB + kPrefetchBytesAvx2 * SB / QB),
                   _MM_HINT_T0);
      group_sums_quads<KIND, MB>(p, qg, m0, g0 + i, sums[i]);
    }
    for (int h = 0; h < 2; ++h)
      for (int64_t i = 0; i < gn; ++i) scale_group_avx2<KIND, MB, 2>(p, t, m0, g0 + i, h, &sums[i][0][h], acc[h]);
  }
  for (int j = 0; j < MB; ++j) {
    _mm256_storeu_ps(out[j], acc[0][j]);
    _mm256_storeu_ps(out[j] + 8, acc[1][j]);
  }
}

// One activation row m (a single stream's decode step and its LM head; a batch's last row): both
// halves of the tile in one pass over its weights, each 64-byte line read once, with two independent
// accumulator chains, and prefetched kPrefetchBytes ahead. The per-row operations of half_tile_avx2, so the same bits.
// Measured on a 2-core AMD EPYC (Zen 2, AVX2 only), the whole model's one-row GEMVs, against two
// half-tile passes with 16 KB prefetches: layers 4.6-5.3 -> 3.8-4.0 ms, the q8_0 head 2.0-2.1 ->
// 1.4-1.6 ms. Two or four tiles side by side (more streams in flight) and prefetches 8 KB or more
// ahead (past what Zen 2's 32 KB L1 holds beside the tile) were slower.
template <int64_t KIND>
KILN_AVX2 void tile_avx2_row(const Problem& p, int64_t t, int64_t m) {
  constexpr int64_t QB = KIND == Q8_0 ? 512 : 256;
  constexpr int64_t SB = KIND == Q4_1 ? 32 : 16;
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < p.G; ++g) {
    const uint8_t* qg = p.qs + (t * p.G + g) * QB;
    const uint16_t* sg = p.scales + (t * p.G + g) * SB;
    for (int64_t b = 0; b < QB; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + kPrefetchBytes + b), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sg + kPrefetchBytes * SB / QB), _MM_HINT_T0);
    const __m256 xd = _mm256_set1_ps(p.xd[m * p.G + g]);
    const __m256 xs = _mm256_set1_ps(p.xs[m * p.G + g]);
    for (int h = 0; h < 2; ++h) {
      __m256i sums;
      group_sums_avx2<KIND, 1>(p, qg + 32 * h, m, g, &sums);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 8 * h)));
      const __m256 mw = KIND == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16 + 8 * h)))
                                     : _mm256_mul_ps(dw, _mm256_set1_ps(-128.0f));
      const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, xd), acc[h]);
      acc[h] = _mm256_fmadd_ps(mw, xs, a);
    }
  }
  alignas(32) float out[kRows];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  store_row_avx2(p, m, t, out);
}

template <int64_t KIND>
void tile_avx2(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  float out[kMaxMB][kRows];
  switch (mb) {
    case 1: return tile_avx2_row<KIND>(p, t, m0);
    case 2: half_tile_avx2<KIND, 2>(p, t, m0, 0, out); half_tile_avx2<KIND, 2>(p, t, m0, 1, out); break;
    case 3: half_tile_avx2<KIND, 3>(p, t, m0, 0, out); half_tile_avx2<KIND, 3>(p, t, m0, 1, out); break;
    case 4: tile_rows_avx2<KIND, 4>(p, t, m0, out); break;
    case 5: tile_rows_avx2<KIND, 5>(p, t, m0, out); break;
    case 6: tile_rows_avx2<KIND, 6>(p, t, m0, out); break;
    case 7: tile_rows_avx2<KIND, 7>(p, t, m0, out); break;
    default: tile_rows_avx2<KIND, 8>(p, t, m0, out); break;
  }
  for (int64_t j = 0; j < mb; ++j) store_row_avx2(p, m0 + j, t, out[j]);
}

#endif  // KILN_X86

// ---------------------------------------------------------------- thread pool

// Runs the chunks of one call on the calling thread plus idle pool threads, each claiming chunks
// from a shared counter. The caller waits for the chunks, not for the threads: on a machine shared
// with other work a descheduled worker only means the others do its share, where an OpenMP region
// would wait at its closing barrier for the worker to be scheduled again (milliseconds per call).
// Workers spin briefly between calls (a decode step issues the next one within microseconds), then
// sleep on a condition variable.
class Pool {
 public:
  using Fn = void (*)(const void* ctx, int64_t chunk);

  // fn(ctx, c) for every c in [0, n) on the caller and up to `helpers` pool threads.
  void run(int64_t n, int helpers, Fn fn, const void* ctx) {
    if (in_chunk_ || helpers <= 0 || n <= 1 || n >= kMaxChunks) return run_inline(n, fn, ctx);   // nested
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return run_inline(n, fn, ctx);   // another thread's call holds the pool
    ensure_threads(helpers);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    helpers_.store(helpers, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & kGenMask;
    word_.store((gen_ << 48) | (static_cast<uint64_t>(n) << 24), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_.notify_all();
    }
    work(gen_);
    while (done_.load(std::memory_order_acquire) < n) spin_pause();
  }

 private:
  static constexpr uint64_t kGenMask = 0xFFFF;
  static constexpr int64_t kMaxChunks = int64_t{1} << 24;
  static constexpr int64_t kSpinNanos = 100000;

  // A chunk's own parallel calls (a DecodeStack part's kernels) run on its thread.
  static thread_local bool in_chunk_;

  struct InChunk {   // an exception out of a chunk must not leave its thread marked
    bool outer = in_chunk_;
    InChunk() { in_chunk_ = true; }
    ~InChunk() { in_chunk_ = outer; }
  };

  static void run_inline(int64_t n, Fn fn, const void* ctx) {
    InChunk mark;
    for (int64_t c = 0; c < n; ++c) fn(ctx, c);
  }

  static uint64_t gen_of(uint64_t w) { return w >> 48; }
  static int64_t total_of(uint64_t w) { return static_cast<int64_t>((w >> 24) & 0xFFFFFF); }
  static int64_t next_of(uint64_t w) { return static_cast<int64_t>(w & 0xFFFFFF); }

  static void spin_pause() {
#ifdef KILN_X86
    _mm_pause();
#endif
  }

  // Claim and run chunks of generation `gen` until none is left (or a newer call replaced it).
  void work(uint64_t gen) {
    for (;;) {
      uint64_t w = word_.load(std::memory_order_acquire);
      if (gen_of(w) != gen || next_of(w) >= total_of(w)) return;
      if (!word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
      // a claimed chunk keeps its call alive, so fn_ and ctx_ are the ones of `gen`
      {
        InChunk mark;
        fn_(ctx_, next_of(w));
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void ensure_threads(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { worker(index); });
    }
  }

  void worker(int index) {
    uint64_t seen = gen_of(word_.load(std::memory_order_acquire));
    for (;;) {
      uint64_t gen = seen;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0;; ++i) {
        gen = gen_of(word_.load(std::memory_order_acquire));
        if (gen != seen) break;
        if ((i & 255) == 255 &&
            std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kSpinNanos)) break;
        spin_pause();
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return gen_of(word_.load(std::memory_order_seq_cst)) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        gen = gen_of(word_.load(std::memory_order_acquire));
      }
      seen = gen;
      if (index < helpers_.load(std::memory_order_relaxed)) work(gen);
    }
  }

  std::mutex run_mu_;                 // one call at a time uses the pool
  std::vector<std::thread> threads_;
  alignas(64) std::atomic<uint64_t> word_{0};  // generation (16 bits) | chunk count (24) | next chunk (24)
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<int> helpers_{0};
  std::atomic<int> sleepers_{0};
  uint64_t gen_ = 0;
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
};

thread_local bool Pool::in_chunk_ = false;

// Never destroyed (joining workers during interpreter exit is asking for trouble); a forked child,
// which has none of the parent's threads and maybe a mutex held by one, starts a fresh pool.
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    static std::once_flag once;
    std::call_once(once, [] {
      g_pool.store(new Pool(), std::memory_order_release);
      pthread_atfork(nullptr, nullptr, [] { g_pool.store(new Pool(), std::memory_order_release); });
    });
    p = g_pool.load(std::memory_order_acquire);
  }
  return *p;
}

}  // namespace

namespace kiln {

// Set by a thread whose kernels run between torch's own ops (training): its chunks go to torch's
// intra-op threads, whose workers still spin after the previous op and would compete with the pool's
// for the same cores (a 1B model's 54-row MLP product took 5.9 ms after a torch matmul, 3.0 alone).
thread_local bool t_torch_threads = false;

bool use_torch_threads(bool on) {
  const bool was = t_torch_threads;
  t_torch_threads = on;
  return was;
}

void parallel_chunks(int64_t n, void (*fn)(const void*, int64_t), const void* ctx) {
  if (t_torch_threads && !at::in_parallel_region()) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) fn(ctx, c);
    });
    return;
  }
  const int helpers = at::in_parallel_region() ? 0 : at::get_num_threads() - 1;
  pool().run(n, helpers, fn, ctx);
}

}  // namespace kiln

namespace {

// The qlinear path for a level: AVX512 needs VNNI here (else the AVX2 code runs).
int64_t resolve_isa(int64_t isa) {
  isa = kiln::resolve_isa(isa, "kiln qlinear");
  if (isa == ISA_AVX512_VNNI && !kiln::cpu_has_avx512_vnni()) return ISA_AVX2;
  return isa;
}

// Scratch for the activations, reused across calls by the calling thread.
struct Scratch {
  std::vector<int8_t> xq;
  std::vector<float> xd, xs, bias;
  std::vector<int32_t> xi;
};
thread_local Scratch scratch;

// xi (integer group sums, which only the AVX2 tiles read) may be null.
void quantize_rows(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int64_t G, int8_t* xq,
                   float* xd, float* xs, int32_t* xi = nullptr) {
#ifdef KILN_X86
  if (isa == ISA_AVX512_VNNI) return quantize_rows_avx512(x, bf16, M, K, G, xq, xd, xs);
  if (isa == ISA_AVX2) return quantize_rows_avx2(x, bf16, M, K, G, xq, xd, xs, xi);
#endif
  quantize_rows_scalar(x, bf16, M, K, G, xq, xd, xs);
}

// quantize_rows with the rows shared out on the pool once there are enough of them: each row is
// quantized on its own, so the bits do not depend on the split. Serial, a 64-row decode step's
// quantization kept the pool's other threads waiting for about 2% of the step.
constexpr int64_t kQuantizeChunk = 8192;   // elements per chunk
void quantize_rows_shared(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int64_t G, int8_t* xq,
                          float* xd, float* xs, int32_t* xi) {
  const int64_t rows = std::max<int64_t>(1, kQuantizeChunk / std::max<int64_t>(1, K));
  struct Job {
    int64_t isa;
    const char* x;
    bool bf16;
    int64_t M, K, G, rows;
    int8_t* xq;
    float *xd, *xs;
    int32_t* xi;
  } job{isa, static_cast<const char*>(x), bf16, M, K, G, rows, xq, xd, xs, xi};
  // one chunk, or no helper threads: the pool runs it inline
  kiln::parallel_chunks(ceil_div(M, rows), [](const void* ctx, int64_t c) {
    const Job& j = *static_cast<const Job*>(ctx);
    const int64_t m0 = c * j.rows, mb = std::min(j.rows, j.M - m0);
    quantize_rows(j.isa, j.x + m0 * j.K * (j.bf16 ? 2 : 4), j.bf16, mb, j.K, j.G, j.xq + m0 * j.G * kGroup,
                  j.xd + m0 * j.G, j.xs + m0 * j.G, j.xi ? j.xi + m0 * j.G : nullptr);
  }, &job);
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), "kiln qlinear: x must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous(), "kiln qlinear: x must be a contiguous [M, K] tensor");
  TORCH_CHECK_VALUE(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
                    "kiln qlinear: x must be float32 or bfloat16");
}

}  // namespace

namespace kiln {

void quantize_activation_rows(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                              float* xs) {
  quantize_rows_shared(::resolve_isa(isa), x, bf16, M, K, (K + kGroup - 1) / kGroup, xq, xd, xs, nullptr);
}

}  // namespace kiln

// x [M, K] float32|bfloat16 -> (int8 [M, G*32], scales [M, G], scale * group sums [M, G]).
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x, int64_t isa) {
  check_x(x);
  isa = resolve_isa(isa);
  const int64_t M = x.size(0), K = x.size(1), G = (K + kGroup - 1) / kGroup;
  auto xq = torch::empty({M, G * kGroup}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, G}, x.options().dtype(torch::kFloat32));
  auto xs = torch::empty({M, G}, x.options().dtype(torch::kFloat32));
  quantize_rows(isa, x.data_ptr(), x.scalar_type() == torch::kBFloat16, M, K, G, xq.data_ptr<int8_t>(),
                xd.data_ptr<float>(), xs.data_ptr<float>());
  return {xq, xd, xs};
}

// x [M, K] float32|bfloat16, K whole superblocks of 256 -> (int8 [M, K], scales [M, K/256], int16 sums of
// every 16 values [M, K/16] and of every 32 [M, K/32]): the K-quant kernels' activations.
std::vector<torch::Tensor> quantize_activations_256(const torch::Tensor& x, int64_t isa) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(K % 256 == 0, "kiln quantize_activations_256: K = ", K, " is not whole superblocks of 256");
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, K / 256}, x.options().dtype(torch::kFloat32));
  auto b16 = torch::empty({M, K / 16}, x.options().dtype(torch::kInt16));
  auto b32 = torch::empty({M, K / 32}, x.options().dtype(torch::kInt16));
  kiln::quantize_activation_rows_256(resolve_isa(isa), x.data_ptr(), x.scalar_type() == torch::kBFloat16, M, K,
                                     xq.data_ptr<int8_t>(), xd.data_ptr<float>(), b16.data_ptr<int16_t>(),
                                     b32.data_ptr<int16_t>());
  return {xq, xd, b16, b32};
}

namespace {

torch::Tensor qlinear_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                         int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(kind == Q4_1 || kind == Q8_0 || kind == IQ4_NL, "kiln qlinear: unknown weight kind ", kind);
  const int64_t M = x.size(0), K = x.size(1), G = (K + kGroup - 1) / kGroup;
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 3 && qs.size(1) == G &&
                  qs.size(2) == qs_group_bytes(kind),
              "kiln qlinear: packed weights do not match x (K = ", K, ")");
  const int64_t T = qs.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.is_contiguous() &&
                  scales.numel() == T * G * scale_group_halfs(kind),
              "kiln qlinear: scales do not match the packed weights");
  TORCH_CHECK(n > (T - 1) * kRows && n <= T * kRows, "kiln qlinear: out_features ", n, " does not match ", T, " tiles");
  isa = resolve_isa(isa);
  auto y = torch::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;

  Scratch& s = scratch;
  const int64_t Kp = G * kGroup;
  s.xq.resize(M * Kp);
  s.xd.resize(M * G);
  s.xs.resize(M * G);
  const bool sums = isa == ISA_AVX2 && kind != Q4_1;   // the |q| and sign trick's activation sums
  if (sums) s.xi.resize(M * G);
  quantize_rows_shared(isa, x.data_ptr(), x.scalar_type() == torch::kBFloat16, M, K, G, s.xq.data(), s.xd.data(),
                s.xs.data(), sums ? s.xi.data() : nullptr);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "kiln qlinear: bias must have out_features elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    s.bias.assign(T * kRows, 0.0f);
    std::memcpy(s.bias.data(), b.data_ptr<float>(), n * sizeof(float));
    bias_ptr = s.bias.data();
  }

  const Problem p{kind, M, n, G, Kp, qs.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), s.xq.data(), s.xd.data(),
                  s.xs.data(), sums ? s.xi.data() : nullptr, bias_ptr, y.data_ptr(), x.scalar_type() == torch::kBFloat16};

  // Chunks of consecutive tiles: long enough runs of memory that a thread streams its weights (a
  // chunk of one 9 KB tile left the 8-row head waiting on DRAM for twice its compute time), and
  // enough chunks that the threads finish together.
  const int64_t tile_bytes = G * qs_group_bytes(kind);
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t per_chunk = std::max(ceil_div(int64_t{16} << 10, tile_bytes),
                                     std::min(ceil_div(int64_t{64} << 10, tile_bytes), ceil_div(T, 4 * threads)));
  // With 8 or more rows a tile is compute, not a stream from DRAM: the chunks shrink to one tile
  // towards the end, so the threads finish together (whoever claims the last chunk is the one the
  // call waits for).
  thread_local std::vector<int64_t> bounds;
  bounds.assign(1, 0);
  // Fewer rows than a block: each tile is read once, in long runs (stream_chunk_tiles)
  const int64_t min_chunk = M >= kMaxMB ? 1 : kiln::stream_chunk_tiles(T, threads, 1, per_chunk);
  for (int64_t t = 0; t < T;) {
    const int64_t guided = (T - t) / (2 * threads);
    t = std::min(T, t + std::max(min_chunk, std::min(per_chunk, guided)));
    bounds.push_back(t);
  }
  struct Job {
    const Problem* p;
    int64_t isa;
    const int64_t* bounds;
  } job{&p, isa, bounds.data()};
  auto run_chunk = [](const void* ctx, int64_t chunk) {
    const Job& j = *static_cast<const Job*>(ctx);
    const Problem& p = *j.p;
    const int64_t t0 = j.bounds[chunk], t1 = j.bounds[chunk + 1];
#ifdef KILN_X86
    {
      // the tile loop prefetches ahead of itself; request the run-up at once (kPrefetchBytes on AVX2
      // too: its whole 16 KB at once measured slower)
      const int64_t qb = p.G * qs_group_bytes(p.kind), sb = p.G * scale_group_halfs(p.kind) * 2;
      const char* q0 = reinterpret_cast<const char*>(p.qs + t0 * qb);
      const char* s0 = reinterpret_cast<const char*>(p.scales) + t0 * sb;
      for (int64_t b = 0; b < kPrefetchBytes; b += 64) _mm_prefetch(q0 + b, _MM_HINT_T0);
      for (int64_t b = 0; b < kPrefetchBytes * sb / qb + 64; b += 64) _mm_prefetch(s0 + b, _MM_HINT_T0);
    }
#endif
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
        const int64_t mb = std::min<int64_t>(kMaxMB, p.M - m0);
#ifdef KILN_X86
        if (j.isa == ISA_AVX512_VNNI) {
          p.kind == Q4_1   ? tile_avx512_any<Q4_1>(p, t, m0, mb)
          : p.kind == Q8_0 ? tile_avx512_any<Q8_0>(p, t, m0, mb)
                           : tile_avx512_any<IQ4_NL>(p, t, m0, mb);
          continue;
        }
        if (j.isa == ISA_AVX2) {
          p.kind == Q4_1 ? tile_avx2<Q4_1>(p, t, m0, mb)
          : p.kind == Q8_0 ? tile_avx2<Q8_0>(p, t, m0, mb)
                           : tile_avx2<IQ4_NL>(p, t, m0, mb);
          continue;
        }
#endif
        tile_scalar(p, t, m0, mb);
      }
    }
  };
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  const int helpers = at::in_parallel_region() ? 0 : at::get_num_threads() - 1;
  pool().run(chunks, helpers, run_chunk, &job);
  return y;
}

}  // namespace

namespace kiln {

// x [..., K] (any float dtype; float32 and bfloat16 run without a conversion) -> [..., n] in x's dtype.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                      int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "kiln qlinear: x has ", x.dim() ? x.size(-1) : 0,
                    " features, the weight expects ", k);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "kiln qlinear: x must be on the CPU");
  const auto dtype = x.scalar_type();
  const bool native = dtype == torch::kFloat32 || dtype == torch::kBFloat16;
  if (native && x.dim() == 2 && x.is_contiguous()) return qlinear_2d(x, qs, scales, kind, n, bias, isa);
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "kiln qlinear: x must be a floating point tensor");
  auto x2 = (native ? x : x.to(torch::kFloat32)).reshape({-1, k}).contiguous();
  auto y = qlinear_2d(x2, qs, scales, kind, n, bias, isa);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  y = y.view(sizes);
  return native ? y : y.to(dtype);
}

}  // namespace kiln

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released: a server's other Python threads keep running during the matmul
  m.def("qlinear", &kiln::qlinear, "y = x @ W^T (+ bias) for tiled q4_1 / q8_0 weights", py::arg("x"), py::arg("qs"),
        py::arg("scales"), py::arg("kind"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("isa") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("qlinear_float", &kiln::qlinear_float, "y = x @ W^T (+ bias) for tiled q4_1 / q8_0 weights, float32 activations",
        py::arg("x"), py::arg("qs"), py::arg("scales"), py::arg("kind"), py::arg("n"), py::arg("k"),
        py::arg("bias") = py::none(), py::arg("isa") = -1, py::arg("out_float") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("qlinear_kquant", &kiln::qlinear_kquant,
        "y = x @ W^T (+ bias) for tiled Q4_K / Q5_K / Q6_K weights, float32 or 8-bit activations", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
        py::arg("isa") = -1, py::arg("out_float") = false, py::arg("float_act") = true,
        py::call_guard<py::gil_scoped_release>());
  m.def("kquant_tiles_from_gguf", &kiln::kquant_tiles_from_gguf, "GGUF K-quant blocks as kquant tiles (qs, scales)",
        py::arg("blocks"), py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("rows"), py::arg("perm"),
        py::arg("super_bytes"), py::arg("out_qs") = py::none(), py::arg("out_scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("kquant_dequantize", &kiln::kquant_dequantize, "the dense weight of kquant tiles", py::arg("qs"),
        py::arg("scales"), py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("bf16"), py::arg("isa") = -1,
        py::arg("out") = py::none(), py::arg("torch_threads") = false, py::call_guard<py::gil_scoped_release>());
  m.def("kquant_dequantize_t", &kiln::kquant_dequantize_t, "columns k0:k1 of kquant tiles' dense weight, transposed",
        py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("k0"), py::arg("k1"),
        py::arg("bf16"), py::arg("isa") = -1, py::arg("out") = py::none(), py::arg("torch_threads") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("kquant_input_grad", &kiln::kquant_input_grad, "grad @ W from kquant tiles (W's bfloat16 values), float32",
        py::arg("qs"), py::arg("scales"), py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("grad"),
        py::arg("isa") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("quantize_activations", &quantize_activations, "per-group int8 activations", py::arg("x"),
        py::arg("isa") = -1);
  m.def("quantize_activations_256", &quantize_activations_256, "per-superblock int8 activations (K-quant kernels)",
        py::arg("x"), py::arg("isa") = -1);
  m.def("use_torch_threads", &kiln::use_torch_threads,
        "this thread's kernels share their work out on torch's intra-op threads (True) or the kernels' pool; "
        "returns the previous setting", py::arg("on"));
  m.def("best_isa", &kiln::cpu_isa, "the highest ISA level this CPU runs: 0 scalar, 1 avx2, 2 avx512");
  m.def("cpu_isa", &kiln::cpu_isa, "the highest ISA level this CPU runs: 0 scalar, 1 avx2, 2 avx512");
  m.def("active_isa", &kiln::active_isa, "the ISA level the kernels use when a call names none");
  m.def("set_isa", &kiln::set_isa, "select the ISA level every kernel uses (at most cpu_isa())", py::arg("isa"));
  m.def("cpu_has_avx512_vnni", &kiln::cpu_has_avx512_vnni, "AVX512-VNNI (int8 dot products) on top of AVX512");
  m.def("cpu_has_avx512_bf16", &kiln::cpu_has_avx512_bf16, "AVX512-BF16 (bfloat16 dot products) on top of AVX512");
  m.def("lora_bgmv_add", &kiln::lora_bgmv_add, "out[i] += (x[i] @ A[s]^T) @ B[s], s = slots[i] (decode LoRA)",
        py::arg("out"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("slots"), py::arg("isa") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &kiln::rms_norm, "F.rms_norm over the last dim of x [T, n]", py::arg("x"), py::arg("w"),
        py::arg("eps"));
  m.def("rope_and_cache", &kiln::rope_and_cache, "rotary in place on q and k, then k and v into their cache slots",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>());
  m.def("greedy_pick", &kiln::greedy_pick, "(argmax, its log-softmax) of each row of float32 logits [B, V]",
        py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &kiln::silu_mul, "silu(gate) * up for [T, n] rows, the same bits at every position",
        py::arg("gate"), py::arg("up"));
  m.def("add_inplace", &kiln::add_inplace, "h += delta, rounded as torch.add rounds", py::arg("h"), py::arg("delta"));
  kiln::register_decode_stack(m);
  m.def("linear_bf16", &kiln::linear_bf16, "y = x @ W^T (+ bias), bfloat16 weights in 16-row tiles of K pairs", py::arg("x"),
        py::arg("tiles"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(), py::arg("isa") = -1,
        py::arg("out_float") = false, py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16_coded", &kiln::linear_bf16_coded,
        "y = x @ W^T (+ bias), bfloat16 weights kept as GGUF codes, rebuilt exactly (linear_bf16's bits)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("kind"), py::arg("n"), py::arg("k"),
        py::arg("bias") = py::none(), py::arg("isa") = -1, py::arg("out_float") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_coded_tiles", &kiln::decode_coded_tiles, "the bfloat16 tiles a coded weight stands for",
        py::arg("codes"), py::arg("scales"), py::arg("kind"), py::arg("n"), py::arg("k"), py::arg("isa") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_dot_supported", &kiln::bf16_dot_supported, "whether linear_bf16 runs on AVX512-BF16");
  m.def("paged_attention", &kiln::paged_attention, "query tokens over their paged context (decode rows)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("lens"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
