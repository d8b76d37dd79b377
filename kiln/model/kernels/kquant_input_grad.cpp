// grad @ W straight from K-quant tiles: the input gradient of a frozen weight held only as blocks, for the
// backward of training and scoring on a CPU without bfloat16 dot products (AVX2, AVX-512 without BF16).
//
// There the product runs in float32, and going through torch meant dequantizing W to bfloat16, widening it
// to a float32 copy and letting sgemm copy that again into its panels: at a training step's few dozen rows
// the three passes over a 64 MB float32 weight took as long as the multiply-adds (a 1B model's MLP, AVX2
// Zen 3). Here each 16-row x 256-column piece of W is decoded into a 16 KB buffer (kquant_dequantize's
// bfloat16 values, widened) and multiplied from there while it is in L1, so the weight is read once, as its
// blocks.
//
// Every output is one chain of fused multiply-adds over W's rows in order, acc = fma(grad[m, i], W[i, c],
// acc) for i = 0 .. n-1 from acc = 0, on every ISA: the scalar path (std::fma) is the reference and the AVX2
// and AVX-512 paths give its bits; a row's result depends on neither the other rows nor the thread count
// (a task owns whole outputs: one superblock of columns for up to kTaskRows rows of grad).

#include "kquant_pack.h"

#include <ATen/Parallel.h>

#include "isa.h"
#include "kquant_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kiln::kq;

// Rows of grad one task multiplies at most: a task decodes its superblock of every tile (about a quarter of
// the time at 64 rows on AVX2), so more rows decode less often; its outputs (1 KB a row) stay in L2.
constexpr int64_t kTaskRows = 256;
// Outputs one task accumulates at most (floats: 256 KB).
constexpr int64_t kTaskValues = 64 * 1024;

struct Job {
  const uint8_t* qs;   // [T, S, super_bytes]
  const uint8_t* sc;   // [T, S, scale_bytes]
  int fmt;
  int64_t isa, S, n, k, M;
  const float* grad;   // [M, n]
  float* out;          // [M, k]
};

void widen_scalar(const uint16_t* bits, int64_t count, float* w) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(w + i, &u, 4);
  }
}

#ifdef KILN_KQ_X86
// bfloat16 bits to float32, 8 at a time (count: a multiple of 256)
KILN_KQ_AVX2 void widen_avx2(const uint16_t* bits, int64_t count, float* w) {
  for (int64_t i = 0; i < count; i += 8) {
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(bits + i));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
}
#endif

// Tile t's superblock s (its `rows` rows, 256 values each) as float32: the bfloat16 values widened.
void decode(const Job& j, int64_t t, int64_t s, int64_t rows, uint16_t* bits, float* w) {
  const int64_t at = t * j.S + s;
  kiln::kquant_decode_superblock(j.fmt, j.isa, j.qs + at * super_bytes(j.fmt), j.sc + at * scale_bytes(j.fmt), rows,
                                 bits);
#ifdef KILN_KQ_X86
  if (j.isa >= kiln::ISA_AVX2) return widen_avx2(bits, rows * kSuper, w);
#endif
  widen_scalar(bits, rows * kSuper, w);
}

// acc[m, c] = fma(g[m, r], w[r, c], acc[m, c]) for r = 0 .. rows-1, for `mc` rows m (g's stride ldg, acc's
// lda) and the 256 columns c of w.
void accumulate_scalar(const float* w, int64_t rows, const float* g, int64_t ldg, int64_t mc, float* acc, int64_t lda) {
  for (int64_t m = 0; m < mc; ++m) {
    float* a = acc + m * lda;
    for (int64_t r = 0; r < rows; ++r) {
      const float x = g[m * ldg + r];
      const float* wr = w + r * kSuper;
      for (int c = 0; c < kSuper; ++c) a[c] = std::fma(x, wr[c], a[c]);
    }
  }
}

#ifdef KILN_KQ_X86

// MB rows at a time, 16 columns (two vectors) per pass: 2 loads of w and MB broadcasts feed 2 * MB fmas.
template <int MB>
KILN_KQ_AVX2 inline void rows_avx2(const float* w, int64_t rows, const float* g, int64_t ldg, float* acc, int64_t lda) {
  for (int c = 0; c < kSuper; c += 16) {
    __m256 a[MB][2];
    for (int i = 0; i < MB; ++i) {
      a[i][0] = _mm256_loadu_ps(acc + i * lda + c);
      a[i][1] = _mm256_loadu_ps(acc + i * lda + c + 8);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 w0 = _mm256_load_ps(w + r * kSuper + c), w1 = _mm256_load_ps(w + r * kSuper + c + 8);
      for (int i = 0; i < MB; ++i) {
        const __m256 x = _mm256_broadcast_ss(g + i * ldg + r);
        a[i][0] = _mm256_fmadd_ps(x, w0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(x, w1, a[i][1]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      _mm256_storeu_ps(acc + i * lda + c, a[i][0]);
      _mm256_storeu_ps(acc + i * lda + c + 8, a[i][1]);
    }
  }
}

KILN_KQ_AVX2 void accumulate_avx2(const float* w, int64_t rows, const float* g, int64_t ldg, int64_t mc, float* acc,
                                  int64_t lda) {
  int64_t m = 0;
  for (; m + 6 <= mc; m += 6) rows_avx2<6>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
  switch (mc - m) {
    case 5: return rows_avx2<5>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
    case 4: return rows_avx2<4>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
    case 3: return rows_avx2<3>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
    case 2: return rows_avx2<2>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
    case 1: return rows_avx2<1>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
    default: return;
  }
}

// rows_avx2 with 16-lane vectors: 32 columns a pass, 8 rows (16 of the 32 registers accumulate).
template <int MB>
KILN_KQ_AVX512 inline void rows_avx512(const float* w, int64_t rows, const float* g, int64_t ldg, float* acc,
                                       int64_t lda) {
  for (int c = 0; c < kSuper; c += 32) {
    __m512 a[MB][2];
    for (int i = 0; i < MB; ++i) {
      a[i][0] = _mm512_loadu_ps(acc + i * lda + c);
      a[i][1] = _mm512_loadu_ps(acc + i * lda + c + 16);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 w0 = _mm512_load_ps(w + r * kSuper + c), w1 = _mm512_load_ps(w + r * kSuper + c + 16);
      for (int i = 0; i < MB; ++i) {
        const __m512 x = _mm512_set1_ps(g[i * ldg + r]);
        a[i][0] = _mm512_fmadd_ps(x, w0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(x, w1, a[i][1]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      _mm512_storeu_ps(acc + i * lda + c, a[i][0]);
      _mm512_storeu_ps(acc + i * lda + c + 16, a[i][1]);
    }
  }
}

KILN_KQ_AVX512 void accumulate_avx512(const float* w, int64_t rows, const float* g, int64_t ldg, int64_t mc,
                                      float* acc, int64_t lda) {
  int64_t m = 0;
  for (; m + 8 <= mc; m += 8) rows_avx512<8>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
  for (; m + 4 <= mc; m += 4) rows_avx512<4>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
  for (; m < mc; ++m) rows_avx512<1>(w, rows, g + m * ldg, ldg, acc + m * lda, lda);
}

#endif

// One task: superblocks s0:s1 of W's columns for grad's rows m0:m1, tile by tile, so it reads each tile's
// records of those superblocks in one run. Its grad columns and outputs go through contiguous buffers:
// grad's rows lie n floats apart and the outputs' k apart, multiples of 4 KB that would put every row in
// one L1 set.
void run_task(const Job& j, int64_t s0, int64_t s1, int64_t m0, int64_t m1) {
  alignas(64) uint16_t bits[kRows * kSuper];
  alignas(64) float w[kRows * kSuper];
  thread_local std::vector<float> buffer;
  const int64_t mc = m1 - m0, T = (j.n + kRows - 1) / kRows, width = (s1 - s0) * kSuper;
  const int64_t need = mc * (kRows + width) + 16;
  if (static_cast<int64_t>(buffer.size()) < need) buffer.resize(need);
  float* g = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;   // 64-byte aligned
  float* acc = g + mc * kRows;   // [s1 - s0][mc][256]
  std::memset(acc, 0, mc * width * sizeof(float));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t rows = j.n - t * kRows < kRows ? j.n - t * kRows : kRows;
    for (int64_t m = 0; m < mc; ++m) std::memcpy(g + m * kRows, j.grad + (m0 + m) * j.n + t * kRows, rows * 4);
    for (int64_t s = s0; s < s1; ++s) {
      decode(j, t, s, rows, bits, w);
      float* a = acc + (s - s0) * mc * kSuper;
#ifdef KILN_KQ_X86
      if (j.isa >= kiln::ISA_AVX512) {
        accumulate_avx512(w, rows, g, kRows, mc, a, kSuper);
        continue;
      }
      if (j.isa >= kiln::ISA_AVX2) {
        accumulate_avx2(w, rows, g, kRows, mc, a, kSuper);
        continue;
      }
#endif
      accumulate_scalar(w, rows, g, kRows, mc, a, kSuper);
    }
  }
  for (int64_t s = s0; s < s1; ++s)
    for (int64_t m = 0; m < mc; ++m)
      std::memcpy(j.out + (m0 + m) * j.k + s * kSuper, acc + ((s - s0) * mc + m) * kSuper, kSuper * 4);
}

}  // namespace

namespace kiln {

torch::Tensor kquant_input_grad(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                int64_t k, const torch::Tensor& grad, int64_t isa) {
  const int f = kquant_checked_format(qs, scales, fmt, n, k, "kquant_input_grad");
  const int64_t S = k / kSuper;
  TORCH_CHECK_VALUE(grad.device().is_cpu() && grad.scalar_type() == torch::kFloat32 && grad.dim() == 2 &&
                        grad.size(1) == n,
                    "kquant_input_grad: grad must be a CPU float32 [M, ", n, "] tensor");
  const int64_t level = resolve_isa(isa, "kiln kquant_input_grad");
  const torch::Tensor g = grad.contiguous();
  const int64_t M = g.size(0);
  torch::Tensor y = torch::empty({M, k}, g.options());
  if (M == 0 || k == 0) return y;
  if (n == 0) return y.zero_();
  const Job j{qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), f, level, S, n, k, M, g.data_ptr<float>(),
              y.data_ptr<float>()};
  // Tasks of whole superblocks and rows (the split never changes a bit): at least one per thread, each
  // with at most kTaskRows rows and kTaskValues outputs (its buffer stays in L2), as few as that allows.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = (M + kTaskRows - 1) / kTaskRows;
  if (S * chunks < threads) chunks = std::min(M, (threads + S - 1) / S);
  const int64_t rows = (M + chunks - 1) / chunks;
  const int64_t by_threads = std::max<int64_t>(1, S * chunks / threads) / chunks;
  const int64_t group = std::max<int64_t>(1, std::min(by_threads, kTaskValues / (rows * kSuper)));
  const int64_t groups = (S + group - 1) / group;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t s0 = (c % groups) * group, m0 = (c / groups) * rows;
      if (m0 < M) run_task(j, s0, std::min(S, s0 + group), m0, std::min(M, m0 + rows));
    }
  });
  return y;
}

}  // namespace kiln
