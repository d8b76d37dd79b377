// Batched multi-adapter LoRA (BGMV): out[i] += (x[i] @ A[s]^T) @ B[s], s = slots[i], for the decode
// rows of a step and the rows of its prefill chunks alike.
//
// A is [S, R, K] and B is [S, R, N] (float32, or bfloat16 for a bfloat16 model: half the bytes; the
// adapter scale folded into B); slot 0 is the base
// model and is skipped. Rows are visited grouped by slot, so each adapter's factors come from memory
// once per call and stay in cache for its other rows. Per row: R dot products of length K, then one
// pass over N that keeps blocks of the delta in registers across all R ranks and adds them to `out`
// (float32 or bfloat16, accumulated in float32). torch's bmm over gathered factors copies every
// row's A and B first; this reads them in place, which is most of the difference at decode sizes.
// A prefill chunk brings many rows of one slot: AVX-512 takes them four at a time, loading each
// factor vector once for the four (the per-row loop is load-bound there), with every row's products
// and sums in the per-row order, so a row's bits never depend on its neighbours.
//
// Like qlinear.cpp, the SIMD functions carry their own target attributes and are picked from cpuid.

#include "lora_bgmv.h"

#include "bf16_simd.h"
#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_LORA_X86 1
#include <immintrin.h>
#endif

namespace {

enum LoraIsa { LORA_SCALAR = 0, LORA_AVX2 = 1, LORA_AVX512 = 2 };

// xa[r] = dot(x, a[r]) for r < R; d[0:N] = sum_r xa[r] * b[r]   (d is overwritten)
void row_scalar(const float* x, const float* a, const float* b, int64_t R, int64_t K, int64_t N, float* xa,
                float* d) {
  for (int64_t r = 0; r < R; ++r) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += x[k] * a[r * K + k];
    xa[r] = s;
  }
  for (int64_t n = 0; n < N; ++n) d[n] = 0.f;
  for (int64_t r = 0; r < R; ++r) {
    const float* br = b + r * N;
    for (int64_t n = 0; n < N; ++n) d[n] += xa[r] * br[n];
  }
}

inline float kiln_lora_widen(float v) { return v; }
inline float kiln_lora_widen(uint16_t v) { return kiln::bf16_bits_to_float(v); }

#ifdef KILN_LORA_X86
#define KILN_LORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define KILN_LORA_AVX2 __attribute__((target("avx2,fma")))

constexpr int64_t kPrefetchBytes = 4096;   // how far ahead in A
constexpr int64_t kPrefetchAheadB = 256;   // elements ahead in each of B's R rows (4 blocks of 64)

// 16 factor values as float32: float32 as they are, bfloat16 (uint16 bits) widened exactly
KILN_LORA_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KILN_LORA_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
KILN_LORA_AVX512 inline __m512 load16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
KILN_LORA_AVX512 inline __m512 load16(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// xa[i * R + j] = dot(x_i, a[j]) for ROWS rows i and RB ranks j (a: the RB ranks' rows); each sum is
// two float32 chains over alternate 16-column blocks (the tail in the second), then added
template <typename W, int ROWS, int RB>
KILN_LORA_AVX512 inline void xa_block(const float* const* xs, const W* a, int64_t K, float* xa, int64_t R) {
  const int64_t k16 = K & ~int64_t(15);
  const __mmask16 kmask = static_cast<__mmask16>((1u << (K - k16)) - 1);
  __m512 acc0[ROWS][RB], acc1[ROWS][RB];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < RB; ++j) acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k16; k += 32) {
    __m512 a0[RB], a1[RB];
    for (int j = 0; j < RB; ++j) {
      a0[j] = load16(a + j * K + k);
      a1[j] = load16(a + j * K + k + 16);
    }
    for (int i = 0; i < ROWS; ++i) {
      const __m512 x0 = _mm512_loadu_ps(xs[i] + k), x1 = _mm512_loadu_ps(xs[i] + k + 16);
      for (int j = 0; j < RB; ++j) {
        acc0[i][j] = _mm512_fmadd_ps(x0, a0[j], acc0[i][j]);
        acc1[i][j] = _mm512_fmadd_ps(x1, a1[j], acc1[i][j]);
      }
    }
  }
  for (; k < k16; k += 16)
    for (int j = 0; j < RB; ++j) {
      const __m512 aj = load16(a + j * K + k);
      for (int i = 0; i < ROWS; ++i) acc0[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i] + k), aj, acc0[i][j]);
    }
  if (kmask)
    for (int j = 0; j < RB; ++j) {
      const __m512 aj = load16(kmask, a + j * K + k16);
      for (int i = 0; i < ROWS; ++i)
        acc1[i][j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(kmask, xs[i] + k16), aj, acc1[i][j]);
    }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < RB; ++j) xa[i * R + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j]));
}

// ROWS rows of one adapter: xa [ROWS, R] and d [ROWS, N] (d[i] = sum_r xa[i, r] * b[r], overwritten).
// W: float (float32 factors) or uint16_t (bfloat16 factors, half the bytes to stream). Either way
// every product and sum is float32, in an order that does not depend on ROWS or W: a row gets the same
// bits in a block of four as alone, and bfloat16 factors give the bits of float32 factors holding the
// same values. One row is a decode row, whose factors come from DRAM: it asks for A and B ahead of use.
// Four rows come from a prefill chunk and share every factor load.
template <typename W, int ROWS>
KILN_LORA_AVX512 void rows_avx512(const float* const* xs, const W* a, const W* b, int64_t R, int64_t K, int64_t N,
                                  float* xa, float* d) {
  constexpr bool stream = ROWS == 1;
  constexpr int64_t E = sizeof(W);
  const char* abytes = reinterpret_cast<const char*>(a);
  const int64_t abytes_n = R * K * E;
  auto prefetch_a = [&](int64_t from, int64_t to) {
    for (int64_t off = from; off < std::min<int64_t>(abytes_n, to); off += 64) _mm_prefetch(abytes + off, _MM_HINT_T0);
  };
  if (stream) prefetch_a(0, kPrefetchBytes);
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    if (stream) prefetch_a(r * K * E + kPrefetchBytes, (r + 2) * K * E + kPrefetchBytes);
    xa_block<W, ROWS, 2>(xs, a + r * K, K, xa + r, R);
  }
  for (; r < R; ++r) {
    if (stream) prefetch_a(r * K * E + kPrefetchBytes, (r + 1) * K * E + kPrefetchBytes);
    xa_block<W, ROWS, 1>(xs, a + r * K, K, xa + r, R);
  }
  if (stream)
    for (int64_t q = 0; q < R; ++q) _mm_prefetch(reinterpret_cast<const char*>(b + q * N), _MM_HINT_T0);
  int64_t n = 0;
  for (; n + 64 <= N; n += 64) {
    __m512 acc[ROWS][4];
    for (int i = 0; i < ROWS; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t q = 0; q < R; ++q) {
      const W* br = b + q * N + n;
      if (stream)
        for (int64_t e = 0; e < 64 * E; e += 64)
          _mm_prefetch(reinterpret_cast<const char*>(br + kPrefetchAheadB) + e, _MM_HINT_T0);
      const __m512 b0 = load16(br), b1 = load16(br + 16), b2 = load16(br + 32), b3 = load16(br + 48);
      for (int i = 0; i < ROWS; ++i) {
        const __m512 s = _mm512_set1_ps(xa[i * R + q]);
        acc[i][0] = _mm512_fmadd_ps(s, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(s, b1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(s, b2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(s, b3, acc[i][3]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(d + i * N + n + 16 * c, acc[i][c]);
  }
  for (; n < N; n += 16) {
    const __mmask16 m = N - n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (N - n)) - 1);
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t q = 0; q < R; ++q) {
      const __m512 bq = load16(m, b + q * N + n);
      for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xa[i * R + q]), bq, acc[i]);
    }
    for (int i = 0; i < ROWS; ++i) _mm512_mask_storeu_ps(d + i * N + n, m, acc[i]);
  }
}

// bf16 -> f32 is exact (a 16-bit shift); f32 -> bf16 rounds to nearest even like c10::BFloat16.
KILN_LORA_AVX512 void bf16_to_f32_avx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
}

KILN_LORA_AVX512 void add_to_bf16_avx512(uint16_t* out, const float* d, int64_t n) {
  int64_t i = 0;
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + i)));
    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_loadu_ps(d + i));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  auto* o = reinterpret_cast<c10::BFloat16*>(out);
  for (; i < n; ++i) o[i] = static_cast<c10::BFloat16>(static_cast<float>(o[i]) + d[i]);
}

// ---- AVX2 (+FMA): rows_avx512's plan with 8-lane vectors (its own bits, invariant alike) ----

KILN_LORA_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KILN_LORA_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

KILN_LORA_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// xa[i * R + j] = dot(x_i, a[j]) for ROWS rows and RB ranks: two chains over alternate 8-column
// blocks, added, then the K % 8 tail in order
template <typename W, int ROWS, int RB>
KILN_LORA_AVX2 inline void xa_block_avx2(const float* const* xs, const W* a, int64_t K, float* xa, int64_t R) {
  const int64_t k8 = K & ~int64_t(7);
  __m256 acc0[ROWS][RB], acc1[ROWS][RB];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < RB; ++j) acc0[i][j] = acc1[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k8; k += 16) {
    __m256 a0[RB], a1[RB];
    for (int j = 0; j < RB; ++j) {
      a0[j] = load8(a + j * K + k);
      a1[j] = load8(a + j * K + k + 8);
    }
    for (int i = 0; i < ROWS; ++i) {
      const __m256 x0 = _mm256_loadu_ps(xs[i] + k), x1 = _mm256_loadu_ps(xs[i] + k + 8);
      for (int j = 0; j < RB; ++j) {
        acc0[i][j] = _mm256_fmadd_ps(x0, a0[j], acc0[i][j]);
        acc1[i][j] = _mm256_fmadd_ps(x1, a1[j], acc1[i][j]);
      }
    }
  }
  for (; k < k8; k += 8)
    for (int j = 0; j < RB; ++j) {
      const __m256 aj = load8(a + j * K + k);
      for (int i = 0; i < ROWS; ++i) acc0[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + k), aj, acc0[i][j]);
    }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < RB; ++j) {
      float s = hsum8(_mm256_add_ps(acc0[i][j], acc1[i][j]));
      for (int64_t t = k8; t < K; ++t) s += xs[i][t] * kiln_lora_widen(a[j * K + t]);
      xa[i * R + j] = s;
    }
}

// rows_avx512 on AVX2: ROWS rows of one adapter, xa [ROWS, R], d [ROWS, N] overwritten.
template <typename W, int ROWS>
KILN_LORA_AVX2 void rows_avx2(const float* const* xs, const W* a, const W* b, int64_t R, int64_t K, int64_t N,
                              float* xa, float* d) {
  constexpr bool stream = ROWS == 1;
  constexpr int64_t E = sizeof(W);
  const char* abytes = reinterpret_cast<const char*>(a);
  const int64_t abytes_n = R * K * E;
  auto prefetch_a = [&](int64_t from, int64_t to) {
    for (int64_t off = from; off < std::min<int64_t>(abytes_n, to); off += 64) _mm_prefetch(abytes + off, _MM_HINT_T0);
  };
  if (stream) prefetch_a(0, kPrefetchBytes);
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) {
    if (stream) prefetch_a(r * K * E + kPrefetchBytes, (r + 2) * K * E + kPrefetchBytes);
    xa_block_avx2<W, ROWS, 2>(xs, a + r * K, K, xa + r, R);
  }
  for (; r < R; ++r) {
    if (stream) prefetch_a(r * K * E + kPrefetchBytes, (r + 1) * K * E + kPrefetchBytes);
    xa_block_avx2<W, ROWS, 1>(xs, a + r * K, K, xa + r, R);
  }
  int64_t n = 0;
  for (; n + 32 <= N; n += 32) {
    __m256 acc[ROWS][4];
    for (int i = 0; i < ROWS; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_setzero_ps();
    for (int64_t q = 0; q < R; ++q) {
      const W* br = b + q * N + n;
      if (stream) _mm_prefetch(reinterpret_cast<const char*>(br + kPrefetchAheadB), _MM_HINT_T0);
      const __m256 b0 = load8(br), b1 = load8(br + 8), b2 = load8(br + 16), b3 = load8(br + 24);
      for (int i = 0; i < ROWS; ++i) {
        const __m256 s = _mm256_set1_ps(xa[i * R + q]);
        acc[i][0] = _mm256_fmadd_ps(s, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(s, b1, acc[i][1]);
        acc[i][2] = _mm256_fmadd_ps(s, b2, acc[i][2]);
        acc[i][3] = _mm256_fmadd_ps(s, b3, acc[i][3]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(d + i * N + n + 8 * c, acc[i][c]);
  }
  for (; n < N; ++n)
    for (int i = 0; i < ROWS; ++i) {
      float s = 0.f;
      for (int64_t q = 0; q < R; ++q) s = std::fma(xa[i * R + q], kiln_lora_widen(b[q * N + n]), s);
      d[i * N + n] = s;
    }
}

KILN_LORA_AVX2 void bf16_to_f32_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = kiln::bf16_bits_to_float(src[i]);
}

KILN_LORA_AVX2 void add_to_bf16_avx2(uint16_t* out, const float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_add_ps(load8(out + i), _mm256_loadu_ps(d + i));
    kiln::store_bf16_bits8(out + i, kiln::bf16_bits8(v));
  }
  auto* o = reinterpret_cast<c10::BFloat16*>(out);
  for (; i < n; ++i) o[i] = static_cast<c10::BFloat16>(static_cast<float>(o[i]) + d[i]);
}
#endif  // KILN_LORA_X86

}  // namespace

namespace kiln {

void lora_bgmv_add(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                   const torch::Tensor& slots, int64_t isa) {
  TORCH_CHECK_VALUE(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3 && slots.dim() == 1,
                    "kiln lora_bgmv: out [T, N], x [T, K], a [S, R, K], b [S, R, N], slots [B]");
  TORCH_CHECK_VALUE(out.device().is_cpu() && x.device().is_cpu() && a.device().is_cpu() && b.device().is_cpu() &&
                        slots.device().is_cpu(),
                    "kiln lora_bgmv: CPU tensors only");
  TORCH_CHECK_VALUE((a.scalar_type() == torch::kFloat32 || a.scalar_type() == torch::kBFloat16) &&
                        b.scalar_type() == a.scalar_type() && a.is_contiguous() && b.is_contiguous(),
                    "kiln lora_bgmv: a and b must be contiguous, both float32 or both bfloat16");
  const bool bf16_factors = a.scalar_type() == torch::kBFloat16;
  TORCH_CHECK_VALUE(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "kiln lora_bgmv: int64 slots");
  const int64_t rows = slots.size(0), S = a.size(0), R = a.size(1), K = a.size(2), N = b.size(2);
  TORCH_CHECK_VALUE(b.size(0) == S && b.size(1) == R && x.size(1) == K && out.size(1) == N && x.size(0) >= rows &&
                        out.size(0) >= rows,
                    "kiln lora_bgmv: shape mismatch");
  const auto out_type = out.scalar_type(), x_type = x.scalar_type();
  TORCH_CHECK_VALUE((out_type == torch::kFloat32 || out_type == torch::kBFloat16) &&
                        (x_type == torch::kFloat32 || x_type == torch::kBFloat16),
                    "kiln lora_bgmv: float32 or bfloat16 activations");
  TORCH_CHECK_VALUE(out.stride(1) == 1 && x.stride(1) == 1, "kiln lora_bgmv: rows must be contiguous");
  const int use = static_cast<int>(kiln::resolve_isa(isa, "kiln lora_bgmv"));

  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [slot](int64_t i, int64_t j) { return slot[i] < slot[j]; });

  const float* af = bf16_factors ? nullptr : a.data_ptr<float>();
  const float* bf = bf16_factors ? nullptr : b.data_ptr<float>();
  const uint16_t* ah = bf16_factors ? reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()) : nullptr;
  const uint16_t* bh = bf16_factors ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK_VALUE(slot[i] < S, "kiln lora_bgmv: slot ", slot[i], " is outside the bank's ", S, " slots");
  // Tasks on the kernels' pool, which a decode step keeps awake: one per adapter (a run of
  // slot-sorted rows), split every kRowsPerTask rows so a prefill chunk's many rows of one adapter
  // use both cores too; at decode sizes the adapters' factors are as many bytes as the base weights,
  // so both cores should stream them. A row's result depends only on its own x and slot, never on
  // the task split.
  constexpr int64_t kRowsPerTask = 32;
  std::vector<int64_t> starts;
  for (int64_t j = 0; j < rows; ++j)
    if (slot[order[j]] > 0 && (starts.empty() || slot[order[j]] != slot[order[j - 1]] || j - starts.back() >= kRowsPerTask))
      starts.push_back(j);
  const int64_t tasks = static_cast<int64_t>(starts.size());
  starts.push_back(rows);
  kiln::parallel_tasks(tasks, [&](int64_t g) {
    thread_local std::vector<float> xrows, xa, d, a32, b32;
    xrows.resize(static_cast<size_t>(4 * K));
    xa.resize(static_cast<size_t>(4 * R));
    d.resize(static_cast<size_t>(4 * N));
    // the task's adapter (tasks hold rows of one slot > 0): the vector paths read bfloat16 factors
    // as they are (widened in registers); the scalar one takes them widened to float32 once per call
    // (exact), so each path computes the same values for either dtype
    const int64_t gs = slot[order[starts[g]]];
    const float* ga = nullptr;
    const float* gb = nullptr;
    const bool direct_bf16 = bf16_factors && use >= LORA_AVX2;
    if (!bf16_factors) {
      ga = af + gs * R * K;
      gb = bf + gs * R * N;
    } else if (!direct_bf16) {
      a32.resize(static_cast<size_t>(R * K));
      b32.resize(static_cast<size_t>(R * N));
      for (int64_t e = 0; e < R * K; ++e) a32[e] = kiln::bf16_bits_to_float(ah[gs * R * K + e]);
      for (int64_t e = 0; e < R * N; ++e) b32[e] = kiln::bf16_bits_to_float(bh[gs * R * N + e]);
      ga = a32.data();
      gb = b32.data();
    }
    // row i's activations as float32 (bfloat16 widened into the q-th scratch row)
    auto x_row = [&](int64_t i, int q) -> const float* {
      if (x_type == torch::kFloat32) return x.data_ptr<float>() + i * x.stride(0);
      const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + i * x.stride(0);
      float* dst = xrows.data() + q * K;
#ifdef KILN_LORA_X86
      if (use == LORA_AVX512) {
        bf16_to_f32_avx512(reinterpret_cast<const uint16_t*>(xb), dst, K);
        return dst;
      }
      if (use == LORA_AVX2) {
        bf16_to_f32_avx2(reinterpret_cast<const uint16_t*>(xb), dst, K);
        return dst;
      }
#endif
      for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(xb[k]);
      return dst;
    };
    // out[i] += delta (float32), or rounded once into bfloat16
    auto add_out = [&](int64_t i, const float* delta) {
      if (out_type == torch::kFloat32) {
        float* o = out.data_ptr<float>() + i * out.stride(0);
        for (int64_t n = 0; n < N; ++n) o[n] += delta[n];
        return;
      }
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + i * out.stride(0);
#ifdef KILN_LORA_X86
      if (use == LORA_AVX512) {
        add_to_bf16_avx512(reinterpret_cast<uint16_t*>(o), delta, N);
        return;
      }
      if (use == LORA_AVX2) {
        add_to_bf16_avx2(reinterpret_cast<uint16_t*>(o), delta, N);
        return;
      }
#endif
      for (int64_t n = 0; n < N; ++n) o[n] = static_cast<c10::BFloat16>(static_cast<float>(o[n]) + delta[n]);
    };
    int64_t j = starts[g];
#ifdef KILN_LORA_X86
    const uint16_t* gah = bf16_factors ? ah + gs * R * K : nullptr;
    const uint16_t* gbh = bf16_factors ? bh + gs * R * N : nullptr;
    // ROWS rows of the task's adapter on the vector path of `use`
    auto vector_rows = [&](auto rows_tag, const float* const* xs) {
      constexpr int ROWS = decltype(rows_tag)::value;
      if (use == LORA_AVX512) {
        if (direct_bf16) return rows_avx512<uint16_t, ROWS>(xs, gah, gbh, R, K, N, xa.data(), d.data());
        return rows_avx512<float, ROWS>(xs, ga, gb, R, K, N, xa.data(), d.data());
      }
      if (direct_bf16) return rows_avx2<uint16_t, ROWS>(xs, gah, gbh, R, K, N, xa.data(), d.data());
      rows_avx2<float, ROWS>(xs, ga, gb, R, K, N, xa.data(), d.data());
    };
    if (use >= LORA_AVX2) {
      for (; j + 4 <= starts[g + 1]; j += 4) {
        const float* xs[4];
        for (int q = 0; q < 4; ++q) xs[q] = x_row(order[j + q], q);
        vector_rows(std::integral_constant<int, 4>{}, xs);
        for (int q = 0; q < 4; ++q) add_out(order[j + q], d.data() + q * N);
      }
    }
#endif
    for (; j < starts[g + 1]; ++j) {
      const int64_t i = order[j];
      const float* xr = x_row(i, 0);
#ifdef KILN_LORA_X86
      if (use >= LORA_AVX2) {
        vector_rows(std::integral_constant<int, 1>{}, &xr);
      } else
#endif
      {
        row_scalar(xr, ga, gb, R, K, N, xa.data(), d.data());
      }
      add_out(i, d.data());
    }
  });
}

}  // namespace kiln
