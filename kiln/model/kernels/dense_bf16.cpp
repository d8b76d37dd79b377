// Dense bfloat16 linear layers for the serving path: y = x @ W^T with W in 16-row tiles whose K
// elements come in pairs (tiled by kiln/model/dense_tiles.py), the layout of AVX512-BF16's vdpbf16ps
// (each 32-bit lane holds one output row's two weights; one broadcast of two activations advances 16
// rows by two K steps).
//
// torch's bfloat16 GEMV on CPU streams weights at 8-10 GB/s (and a CPU without native bf16 dot
// products has only float32 GEMMs, twice the bytes); this reads bfloat16 once per call for up to 8
// activation rows and runs on the kernels' thread pool. Every output element is one float32 chain
// over the K pairs in order, whatever M, the row block, the tile group or the thread: a row's result
// never depends on the batch it shares (concurrent requests equal sequential ones). The three code
// paths compute the same bits:
//   - AVX512-BF16: vdpbf16ps adds the odd element's product to the accumulator, then the even one's,
//     rounding to nearest even each time, denormals flushed (inputs and results).
//   - AVX2 (+FMA; also AVX-512 CPUs without BF16): the weights widen in registers (a bfloat16 is the
//     top half of a float32: one shift or mask per 8 values, never a float32 copy in memory), then
//     two FMAs in the same order. A bfloat16 product is exact in float32, so fma(w, x, acc) rounds
//     exactly as the instruction's add does; MXCSR's FTZ/DAZ flush denormals like it.
//   - scalar: the same operations one at a time (the reference the others are tested against).
// A decode step has one activation row: its 16 rows of a tile are one or two dependency chains, so
// the vector paths run several tiles side by side to keep the FMA units busy (chain latency, not
// bandwidth, bounded the one-tile loop).

#include "dense_bf16.h"

#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_BF16_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;
constexpr int kMaxMB = 8;
// K pairs (64 bytes of a tile each) a tile's stream is prefetched ahead: the tiles of a group are
// separate streams, each of which the hardware prefetcher would pick up only after a few misses
constexpr int64_t kAheadPairs = 32;

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
  const float* xf;            // [M, 2P] x widened, denormals flushed (AVX2 path only)
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

// Tiles [t0, t1) for rows [m0, m0 + mb) on the scalar path.
void run_scalar(const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) tile_scalar(p, t, m0, std::min<int64_t>(kMaxMB, p.M - m0));
}

#ifdef KILN_BF16_X86
#define KILN_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define KILN_BF16_AVX2 __attribute__((target("avx2,fma")))

// ---------------------------------------------------------------- AVX512-BF16

// NT tiles from t, MB rows from m0: NT * MB independent chains.
template <int NT, int MB>
KILN_BF16 void tiles_avx512(const Problem& p, int64_t t, int64_t m0) {
  const uint16_t* w = p.tiles + t * p.P * 32;
  const int64_t tile = p.P * 32;
  __m512 acc[NT][MB];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * p.P * 2;
  for (int64_t q = 0; q < p.P; ++q) {
    __m512bh xv[MB];
    for (int j = 0; j < MB; ++j) {
      int32_t pair;
      std::memcpy(&pair, x + j * p.P * 2 + 2 * q, 4);
      xv[j] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int i = 0; i < NT; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i * tile + (q + kAheadPairs) * 32), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * tile + q * 32);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  alignas(64) float out[kRows];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) {
      _mm512_store_ps(out, acc[i][j]);
      store(p, m0 + j, t + i, out);
    }
}

// Rows [0, M) of tiles [t0, t1): groups of tiles side by side for few rows, row blocks for many.
template <int NT1, int NT2, int NT4, int NT8>
void run_blocks(const Problem& p, int64_t t0, int64_t t1, void (*fn)(int nt, int mb, const Problem&, int64_t, int64_t)) {
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
    const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
    const int nt = mb == 1 ? NT1 : mb == 2 ? NT2 : mb <= 4 ? NT4 : NT8;
    int64_t t = t0;
    for (; t + nt <= t1; t += nt) fn(nt, mb, p, t, m0);
    for (; t < t1; ++t) fn(1, mb, p, t, m0);
  }
}

void dispatch_avx512(int nt, int mb, const Problem& p, int64_t t, int64_t m0) {
#define KILN_CASE(NT, MB) \
  if (nt == NT && mb == MB) return tiles_avx512<NT, MB>(p, t, m0);
  KILN_CASE(8, 1) KILN_CASE(4, 2) KILN_CASE(2, 3) KILN_CASE(2, 4)
  KILN_CASE(1, 1) KILN_CASE(1, 2) KILN_CASE(1, 3) KILN_CASE(1, 4)
  KILN_CASE(1, 5) KILN_CASE(1, 6) KILN_CASE(1, 7) KILN_CASE(1, 8)
#undef KILN_CASE
  for (int i = 0; i < nt; ++i) dispatch_avx512(1, mb, p, t + i, m0);
}

void run_avx512(const Problem& p, int64_t t0, int64_t t1) {
  run_blocks<8, 4, 2, 1>(p, t0, t1, dispatch_avx512);
}

// ---------------------------------------------------------------- AVX2 (+FMA)

// NT tiles from t, MB rows from m0 (MB <= 4): two ymm accumulators (rows 0-7, 8-15) per tile and row.
template <int NT, int MB>
KILN_BF16_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0) {
  const uint16_t* w = p.tiles + t * p.P * 32;
  const int64_t tile = p.P * 32;
  const int64_t xs = p.P * 2;
  const float* x = p.xf + m0 * xs;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[NT][MB][2];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t q = 0; q < p.P; ++q) {
    for (int i = 0; i < NT; ++i) {
      const uint16_t* wq = w + i * tile + q * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wq + kAheadPairs * 32), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 16));
      // lane r holds (W[r, 2q], W[r, 2q + 1]): the even weight is the low half, the odd one the high
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
      for (int j = 0; j < MB; ++j) {
        const __m256 x0 = _mm256_broadcast_ss(x + j * xs + 2 * q);
        const __m256 x1 = _mm256_broadcast_ss(x + j * xs + 2 * q + 1);
        acc[i][j][0] = _mm256_fmadd_ps(e0, x0, _mm256_fmadd_ps(o0, x1, acc[i][j][0]));
        acc[i][j][1] = _mm256_fmadd_ps(e1, x0, _mm256_fmadd_ps(o1, x1, acc[i][j][1]));
      }
    }
  }
  alignas(32) float out[kRows];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) {
      _mm256_store_ps(out, acc[i][j][0]);
      _mm256_store_ps(out + 8, acc[i][j][1]);
      store(p, m0 + j, t + i, out);
    }
}

void dispatch_avx2(int nt, int mb, const Problem& p, int64_t t, int64_t m0) {
  if (mb > 4) {   // two blocks of rows, each re-reading the tile from L1
    dispatch_avx2(nt, 4, p, t, m0);
    return dispatch_avx2(nt, mb - 4, p, t, m0 + 4);
  }
#define KILN_CASE(NT, MB) \
  if (nt == NT && mb == MB) return tiles_avx2<NT, MB>(p, t, m0);
  KILN_CASE(4, 1) KILN_CASE(2, 2) KILN_CASE(1, 1) KILN_CASE(1, 2) KILN_CASE(1, 3) KILN_CASE(1, 4)
#undef KILN_CASE
  for (int i = 0; i < nt; ++i) dispatch_avx2(1, mb, p, t + i, m0);
}

// Denormal inputs read as zero and denormal results become zero, as in vdpbf16ps.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

void run_avx2(const Problem& p, int64_t t0, int64_t t1) {
  FlushDenormals ftz;
  run_blocks<4, 2, 1, 1>(p, t0, t1, dispatch_avx2);
}

KILN_BF16_AVX2 void widen_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  const __m256i exp = _mm256_set1_epi32(0x7F800000);
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16);
    // denormals (exponent 0) flushed to a signed zero, as the bf16 instruction reads them
    const __m256i denormal = _mm256_cmpeq_epi32(_mm256_and_si256(w, exp), _mm256_setzero_si256());
    const __m256i v = _mm256_andnot_si256(_mm256_and_si256(denormal, _mm256_set1_epi32(0x7FFFFFFF)), w);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(v));
  }
  for (; i < n; ++i) dst[i] = flush_denormal(bf16_bits_to_float(src[i]));
}
#endif

enum Path { SCALAR, AVX2, AVX512_BF16 };

Path path_for(int64_t isa) {
  if (isa >= kiln::ISA_AVX512 && kiln::cpu_has_avx512_bf16()) return AVX512_BF16;
  if (isa >= kiln::ISA_AVX2) return AVX2;
  return SCALAR;
}

}  // namespace

namespace kiln {

bool bf16_dot_supported() { return cpu_has_avx512_bf16(); }

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t k,
                          const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
                    "kiln linear_bf16: x must be a [M, k] bfloat16 CPU tensor");
  const int64_t T = (n + kRows - 1) / kRows, P = (k + 1) / 2;
  TORCH_CHECK_VALUE(tiles.dim() == 3 && tiles.size(0) == T && tiles.size(1) == P && tiles.size(2) == 32 &&
                        tiles.is_contiguous() && tiles.scalar_type() == torch::kBFloat16,
                    "kiln linear_bf16: tiles do not match n and k");
  const Path path = path_for(resolve_isa(isa, "kiln linear_bf16"));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, n}, x.options().dtype(out_float ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;
  // K padded to whole pairs (the padding weights are zero)
  auto xp = (k % 2 || !x.is_contiguous()) ? at::constant_pad_nd(x, {0, 2 * P - k}).contiguous() : x;
  const auto* xbits = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  torch::Tensor b;
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln linear_bf16: bias must have n elements");
    b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  // the AVX2 path broadcasts float32 activations: widened once here (M x K, small next to W)
  thread_local std::vector<float> xf;
#ifdef KILN_BF16_X86
  if (path == AVX2) {
    xf.resize(static_cast<size_t>(M * 2 * P));
    widen_avx2(xbits, xf.data(), M * 2 * P);
  }
#endif
  const Problem p{M, n, P, xbits, xf.data(), reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()),
                  bias_pad.empty() ? nullptr : bias_pad.data(),
                  out_float ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  out_float ? y.data_ptr<float>() : nullptr};
  // chunks of consecutive tiles, whole groups of 8 so a chunk's tiles run side by side
  const int64_t per_chunk = std::max<int64_t>(8, (T / 16 + 7) / 8 * 8);
  const int64_t chunks = (T + per_chunk - 1) / per_chunk;
  kiln::parallel_tasks(chunks, [&](int64_t c) {
    const int64_t t0 = c * per_chunk, t1 = std::min(T, t0 + per_chunk);
#ifdef KILN_BF16_X86
    if (path == AVX512_BF16) return run_avx512(p, t0, t1);
    if (path == AVX2) return run_avx2(p, t0, t1);
#endif
    run_scalar(p, t0, t1);
  });
  return y;
}

}  // namespace kiln
