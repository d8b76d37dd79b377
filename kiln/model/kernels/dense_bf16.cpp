// Dense bfloat16 linear layers for the serving path: y = x @ W^T with W in 16-row tiles whose K
// elements come in pairs (tiled by kiln/model/dense_tiles.py), the layout of AVX512-BF16's vdpbf16ps (each 32-bit lane of a zmm holds one
// output row's two weights; one broadcast of two activations advances 16 rows by two K steps).
//
// torch's bfloat16 GEMV on CPU streams weights at 8-10 GB/s; this reads them once per call for up to
// 8 activation rows and runs on the kernels' thread pool. Every output element is one float32 chain
// over the K pairs in order, whatever M, the row block or the thread: a row's result never depends
// on the batch it shares (concurrent requests equal sequential ones). The scalar path computes the
// same bits (a pair's products are exact in float32; vdpbf16ps adds the odd element's product to the
// accumulator, then the even one's, rounding to nearest even each time and flushing denormals).

#include "dense_bf16.h"

#include "qlinear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_BF16_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;
constexpr int kMaxMB = 8;

using kiln::bf16_bits_to_float;
using kiln::float_to_bf16_bits;

inline float flush_denormal(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Problem {
  int64_t M, N, P;            // rows, outputs, K pairs
  const uint16_t* x;          // [M, 2P] (K padded to even)
  const uint16_t* tiles;      // [T, P, 32]
  const float* bias;          // [T*16] or nullptr
  uint16_t* y;                // [M, N] bfloat16, or
  float* yf;                  // [M, N] float32 (the sums unrounded)
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  const int64_t n0 = t * kRows, cnt = std::min<int64_t>(kRows, p.N - n0);
  for (int64_t r = 0; r < cnt; ++r) {
    const float v = acc[r] + (p.bias ? p.bias[n0 + r] : 0.0f);
    if (p.yf) {
      p.yf[m * p.N + n0 + r] = v;
    } else {
      p.y[m * p.N + n0 + r] = float_to_bf16_bits(v);
    }
  }
}

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  const uint16_t* w = p.tiles + t * p.P * 32;
  for (int64_t j = 0; j < mb; ++j) {
    const uint16_t* x = p.x + (m0 + j) * p.P * 2;
    float acc[kRows] = {};
    for (int64_t q = 0; q < p.P; ++q) {
      const float x0 = flush_denormal(bf16_bits_to_float(x[2 * q]));
      const float x1 = flush_denormal(bf16_bits_to_float(x[2 * q + 1]));
      for (int r = 0; r < kRows; ++r) {
        const float w0 = flush_denormal(bf16_bits_to_float(w[q * 32 + 2 * r]));
        const float w1 = flush_denormal(bf16_bits_to_float(w[q * 32 + 2 * r + 1]));
        // the instruction's order: the odd element's product added first, then the even one's
        acc[r] = flush_denormal(flush_denormal(acc[r] + w1 * x1) + w0 * x0);
      }
    }
    store(p, m0 + j, t, acc);
  }
}

#ifdef KILN_BF16_X86
#define KILN_BF16 __attribute__((target("avx512f,avx512bf16")))

template <int MB>
KILN_BF16 void tile_avx512(const Problem& p, int64_t t, int64_t m0) {
  const uint16_t* w = p.tiles + t * p.P * 32;
  __m512 acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t q = 0; q < p.P; ++q) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + q * 32);
    for (int j = 0; j < MB; ++j) {
      int32_t pair;
      std::memcpy(&pair, p.x + (m0 + j) * p.P * 2 + 2 * q, 4);
      acc[j] = _mm512_dpbf16_ps(acc[j], wv, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
  alignas(64) float out[kRows];
  for (int j = 0; j < MB; ++j) {
    _mm512_store_ps(out, acc[j]);
    store(p, m0 + j, t, out);
  }
}

void tile_avx512_any(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  switch (mb) {
    case 1: return tile_avx512<1>(p, t, m0);
    case 2: return tile_avx512<2>(p, t, m0);
    case 3: return tile_avx512<3>(p, t, m0);
    case 4: return tile_avx512<4>(p, t, m0);
    case 5: return tile_avx512<5>(p, t, m0);
    case 6: return tile_avx512<6>(p, t, m0);
    case 7: return tile_avx512<7>(p, t, m0);
    default: return tile_avx512<8>(p, t, m0);
  }
}
#endif

}  // namespace

namespace kiln {

bool bf16_dot_supported() {
#ifdef KILN_BF16_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t k,
                          const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
                    "kiln linear_bf16: x must be a [M, k] bfloat16 CPU tensor");
  const int64_t T = (n + kRows - 1) / kRows, P = (k + 1) / 2;
  TORCH_CHECK_VALUE(tiles.dim() == 3 && tiles.size(0) == T && tiles.size(1) == P && tiles.size(2) == 32 &&
                        tiles.is_contiguous() && tiles.scalar_type() == torch::kBFloat16,
                    "kiln linear_bf16: tiles do not match n and k");
  const int64_t M = x.size(0);
  auto y = torch::empty({M, n}, x.options().dtype(out_float ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;
  // K padded to whole pairs (the padding weights are zero)
  auto xp = (k % 2 || !x.is_contiguous()) ? at::constant_pad_nd(x, {0, 2 * P - k}).contiguous() : x;
  torch::Tensor b;
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln linear_bf16: bias must have n elements");
    b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  const Problem p{M, n, P, reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()),
                  bias_pad.empty() ? nullptr : bias_pad.data(),
                  out_float ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  out_float ? y.data_ptr<float>() : nullptr};
  const bool vec = bf16_dot_supported() && isa != 0;
  const int64_t per_chunk = std::max<int64_t>(1, T / 16);
  const int64_t chunks = (T + per_chunk - 1) / per_chunk;
  kiln::parallel_tasks(chunks, [&](int64_t c) {
    const int64_t t1 = std::min(T, (c + 1) * per_chunk);
    for (int64_t t = c * per_chunk; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) {
        const int64_t mb = std::min<int64_t>(kMaxMB, M - m0);
#ifdef KILN_BF16_X86
        if (vec) {
          tile_avx512_any(p, t, m0, mb);
          continue;
        }
#endif
        tile_scalar(p, t, m0, mb);
      }
    }
  });
  return y;
}

}  // namespace kiln
