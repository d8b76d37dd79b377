// silu_mul(gate, up): the MLP's silu(gate) * up, one pass, for the serving path's prefill (through
// kiln/model/transformer.py's MLP) and its decode steps (decode_stack.cpp) alike.
//
// Why a kernel of our own: ATen's vectorised silu runs a row's leftover elements (past the last
// whole vector) through a scalar exp that can differ from its vector exp by an ulp. The stack's
// fused gate|up output is a strided view whose rows each have a tail, while the layer path's
// contiguous [T, n] coalesces into one run, so the same element took the vector exp on one path
// and the scalar exp on the other whenever n was not a multiple of twice the vector width.
//
// Here every element goes through one sequence of IEEE operations, whatever its position, the
// row's stride or the ISA: Cephes' expf polynomial with explicit fmas (the scalar path calls
// std::fma, which rounds once as vfmadd does; the build has -ffp-contract=off), an exact division,
// and round-to-nearest-even to bfloat16 as c10::BFloat16 rounds. The vector paths run a row's tail
// through the same vector code: on a zero-padded copy (AVX2) or in masked lanes (AVX-512).

#include "silu_mul.h"

#include "bf16_simd.h"
#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// Elements per task: small enough that a 64-row decode step spreads over the kernels' pool, large
// enough that a single decode row runs inline.
constexpr int64_t kGrain = 16384;

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
// exp's argument is clamped to [kLo, kHi] so that 2^n stays a normal float: below -87, 1 + exp(y)
// is 1 anyway; above 88 (a gate under -88) silu is about gate / 1.6e38 instead of smaller.
constexpr float kLo = -87.f, kHi = 88.f;

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// x86's maxps / minps on one lane: the second operand when either is NaN
inline float max_x86(float a, float b) { return a > b ? a : b; }
inline float min_x86(float a, float b) { return a < b ? a : b; }

inline float silu_scalar(float g) {
  const float y = min_x86(kHi, max_x86(kLo, -g));
  if (y != y) return g / 1.f;   // NaN gate: the vector path's division returns it too
  const float n = std::nearbyint(y * kLog2e);
  float r = std::fma(-n, kLn2Hi, y);
  r = std::fma(-n, kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  p = std::fma(p * r, r, r + 1.f);
  const float e = p * bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return g / (1.f + e);
}

template <typename T>
void row_scalar(const T* g, const T* u, T* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T s = static_cast<T>(silu_scalar(static_cast<float>(g[i])));
    o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
  }
}

}  // namespace

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KILN_SILU_X86 1
#define KILN_SILU_AVX2 __attribute__((target("avx2,fma")))
#define KILN_SILU_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace {

// ---- AVX2: 8 lanes ----
// silu of N vectors at once, each operation applied to all N before the next: one vector's chain of
// ~40 dependent operations (the division alone ~10 cycles of latency) is longer than Zen 2's FP
// scheduler looks ahead, so a loop of one vector per iteration ran at its latency (46 cycles per 8
// bfloat16 elements, 5x the throughput bound). Every lane still goes through the very operations
// of the scalar path, so N changes no bit.
template <int N>
KILN_SILU_AVX2 inline void silu8(__m256* g) {
  __m256 y[N], n[N], r[N], p[N];
  for (int k = 0; k < N; ++k) {
    // -g as 0 - g would turn +0 into +0 where the scalar path's -g gives -0; a sign flip matches it
    const __m256 ny = _mm256_xor_ps(g[k], _mm256_set1_ps(-0.f));
    y[k] = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), ny));
  }
  for (int k = 0; k < N; ++k)
    n[k] = _mm256_round_ps(_mm256_mul_ps(y[k], _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  for (int k = 0; k < N; ++k) r[k] = _mm256_fnmadd_ps(n[k], _mm256_set1_ps(kLn2Hi), y[k]);
  for (int k = 0; k < N; ++k) r[k] = _mm256_fnmadd_ps(n[k], _mm256_set1_ps(kLn2Lo), r[k]);
  for (int k = 0; k < N; ++k) p[k] = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r[k], _mm256_set1_ps(kP1));
  for (int k = 0; k < N; ++k) p[k] = _mm256_fmadd_ps(p[k], r[k], _mm256_set1_ps(kP2));
  for (int k = 0; k < N; ++k) p[k] = _mm256_fmadd_ps(p[k], r[k], _mm256_set1_ps(kP3));
  for (int k = 0; k < N; ++k) p[k] = _mm256_fmadd_ps(p[k], r[k], _mm256_set1_ps(kP4));
  for (int k = 0; k < N; ++k) p[k] = _mm256_fmadd_ps(p[k], r[k], _mm256_set1_ps(kP5));
  for (int k = 0; k < N; ++k)
    p[k] = _mm256_fmadd_ps(_mm256_mul_ps(p[k], r[k]), r[k], _mm256_add_ps(r[k], _mm256_set1_ps(1.f)));
  for (int k = 0; k < N; ++k) {
    // NaN lanes: n is NaN and converts to 0x80000000; e is then some value and g / (1 + e) is g's NaN
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n[k]), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p[k], _mm256_castsi256_ps(two_n));
    g[k] = _mm256_div_ps(g[k], _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
}

KILN_SILU_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KILN_SILU_AVX2 inline __m256 load8(const c10::BFloat16* p) { return kiln::bf16x8_to_float(p); }

// N blocks of 8 consecutive elements
template <int N, typename T>
KILN_SILU_AVX2 inline void blocks8(const T* g, const T* u, T* o) {
  __m256 s[N];
  for (int k = 0; k < N; ++k) s[k] = load8(g + 8 * k);
  silu8<N>(s);
  for (int k = 0; k < N; ++k) {
    if constexpr (std::is_same<T, float>::value) {
      _mm256_storeu_ps(o + 8 * k, _mm256_mul_ps(s[k], load8(u + 8 * k)));
    } else {
      const __m256 r = kiln::round_to_bf16x8(s[k]);
      kiln::store_bf16_bits8(o + 8 * k, kiln::bf16_bits8(_mm256_mul_ps(r, load8(u + 8 * k))));
    }
  }
}

template <typename T>
KILN_SILU_AVX2 void row_avx2(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) blocks8<4>(g + i, u + i, o + i);
  for (; i + 8 <= n; i += 8) blocks8<1>(g + i, u + i, o + i);
  if (i < n) {
    T gb[8] = {}, ub[8] = {}, ob[8];
    std::copy(g + i, g + n, gb);
    std::copy(u + i, u + n, ub);
    blocks8<1>(gb, ub, ob);
    std::copy(ob, ob + (n - i), o + i);
  }
}

// ---- AVX-512: 16 lanes, the same operations ----
KILN_SILU_AVX512 inline __m512 silu16(__m512 g) {
  const __m512 ny = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 y = _mm512_min_ps(_mm512_set1_ps(kHi), _mm512_max_ps(_mm512_set1_ps(kLo), ny));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), y);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(two_n));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

KILN_SILU_AVX512 inline __m512 widen_bf16_16(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }

KILN_SILU_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KILN_SILU_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return widen_bf16_16(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)));
}

// lanes outside m read as 0 and are not stored: a tail runs through the same lanes' operations
template <typename T>
KILN_SILU_AVX512 inline void block16(const T* g, const T* u, T* o, __mmask16 m) {
  if constexpr (std::is_same<T, float>::value) {
    _mm512_mask_storeu_ps(o, m, _mm512_mul_ps(silu16(load16(g, m)), load16(u, m)));
  } else {
    const __m512 s = widen_bf16_16(kiln::bf16_bits16(silu16(load16(g, m))));
    const __m512i bits = kiln::bf16_bits16(_mm512_mul_ps(s, load16(u, m)));
    _mm256_mask_storeu_epi16(o, m, _mm512_cvtepi32_epi16(bits));
  }
}

template <typename T>
KILN_SILU_AVX512 void row_avx512(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) block16(g + i, u + i, o + i, static_cast<__mmask16>(0xFFFF));
  if (i < n) block16(g + i, u + i, o + i, static_cast<__mmask16>((1u << (n - i)) - 1));
}

}  // namespace
#endif

namespace kiln {

torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK_VALUE(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
                    "kiln silu_mul: gate and up [T, n] with contiguous rows");
  TORCH_CHECK_VALUE(gate.scalar_type() == up.scalar_type() &&
                        (gate.scalar_type() == torch::kFloat32 || gate.scalar_type() == torch::kBFloat16),
                    "kiln silu_mul: float32 or bfloat16, one dtype");
  TORCH_CHECK_VALUE(gate.device().is_cpu() && up.device().is_cpu(), "kiln silu_mul: CPU tensors only");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = torch::empty({rows, n}, gate.options());
  if (rows == 0 || n == 0) return out;
  const int64_t isa = kiln::active_isa(), per = std::max<int64_t>(1, kGrain / n);
  const int64_t gs = gate.stride(0), us = up.stride(0);
  auto run = [&](auto* g, auto* u, auto* o) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(o)>>;
    kiln::parallel_tasks((rows + per - 1) / per, [&](int64_t c) {
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const T* gr = g + r * gs;
        const T* ur = u + r * us;
        T* orow = o + r * n;
#ifdef KILN_SILU_X86
        if (isa >= kiln::ISA_AVX512) {
          row_avx512<T>(gr, ur, orow, n);
          continue;
        }
        if (isa >= kiln::ISA_AVX2) {
          row_avx2<T>(gr, ur, orow, n);
          continue;
        }
#endif
        row_scalar<T>(gr, ur, orow, n);
      }
    });
  };
  if (gate.scalar_type() == torch::kFloat32) {
    run(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(gate.data_ptr<c10::BFloat16>(), up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace kiln
