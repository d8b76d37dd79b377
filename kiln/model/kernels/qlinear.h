// Quantized linear layers for small M (see qlinear.cpp).
#pragma once

#include <torch/extension.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln {

#if defined(__x86_64__)
// acc + vpdpbusd(u, the 4 bytes at x broadcast to every int32 lane), the broadcast folded into the
// instruction's memory operand ({1to16}): GCC 12 emits a separate vpbroadcastd for _mm512_set1_epi32 of a
// load, one more vector op for every dot product (AVX512-VNNI K-quant GEMM: 2-6% faster folded).
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}
#endif

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_bits_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The index (tile * G + group) of the group `ahead` groups past group g of tile t in tiled weights, for a
// pass that reads `nt` consecutive tiles side by side: past tile t's end, in tile t + nt (the one the
// pass reads next; tile t + 1 is being read beside t already). Where weight prefetches aim.
// Written as a tile shift on purpose: GCC 12 -O3 dropped every prefetch aimed through the equivalent
// `ga >= G ? (t + nt) * G + ga - G : t * G + ga` (no prefetcht0 left in qlinear_float.o; the one-row
// gguf-float step went back from 5.1-5.3 to 10.8-12.1 ms).
inline int64_t group_ahead(int64_t t, int64_t g, int64_t G, int64_t ahead, int64_t nt) {
  const int64_t ga = g + ahead;
  if (ga >= G) t += nt - 1;
  return t * G + ga;
}

// The tiles a chunk of a decode call (activations that fit one row block) takes, at least `floor`: every
// tile is read once, from memory, so each chunk's start is a stall while the prefetchers find the new
// stream, and nothing is gained by keeping a chunk within L2. About four chunks a thread, in whole
// `multiple`s: long runs of memory, and still enough of them that the threads finish together (on two
// cores of a Zen 4, weights far past the L3: 64 KB chunks gave 10-27% fewer GB/s).
inline int64_t stream_chunk_tiles(int64_t T, int64_t threads, int64_t multiple, int64_t floor) {
  const int64_t parts = 4 * (threads > 1 ? threads : 1);
  const int64_t tiles = ((T + parts - 1) / parts + multiple - 1) / multiple * multiple;
  return tiles > floor ? tiles : floor;
}

// Round to nearest even like c10::BFloat16 (NaN -> 0x7FC0).
inline uint16_t float_to_bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// y = x @ W^T (+ bias) for tiled q4_1 (kind 0) / q8_0 (kind 1) weights; x [..., k] -> [..., n] in x's
// dtype. isa: -1 best, 0 scalar, 1 avx2, 2 avx512-vnni.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                      int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa);

// x [M, K] (float32, or bfloat16 bits with bf16) quantized per group of 32 exactly as qlinear quantizes
// it: int8 xq [M, G*32], scale xd [M, G], xd * the group's int8 sum xs [M, G] (G = ceil(K / 32)); the rows
// are shared out on the kernels' pool. isa: a resolved level (every level gives the same bytes).
void quantize_activation_rows(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                              float* xs);

// x [M, K] (K whole superblocks of 256) quantized per superblock for the K-quant kernels
// (quantize_super.cpp): int8 xq [M, K], scale xd [M, K / 256] (amax / 127), the int8 sums of every 16
// values b16 [M, K / 16] and of every 32 b32 [M, K / 32]; rows shared out on the pool. isa: a resolved
// level (every level gives the same bytes).
void quantize_activation_rows_256(int64_t isa, const void* x, bool bf16, int64_t M, int64_t K, int8_t* xq, float* xd,
                                  int16_t* b16, int16_t* b32);

// fn(ctx, c) for every c in [0, n) on the calling thread and the kernels' own pool (the one qlinear
// uses): a decode step's kernels share one set of threads instead of waking OpenMP's as well, whose
// spinning workers would compete with the pool's for the same cores.
void parallel_chunks(int64_t n, void (*fn)(const void*, int64_t), const void* ctx);

// This thread's parallel_chunks run on torch's intra-op threads (at::parallel_for) while `on`; returns the
// previous setting. The split never changes a result's bits: every chunk computes whole rows.
bool use_torch_threads(bool on);

template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  parallel_chunks(n, [](const void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); }, &f);
}

}  // namespace kiln
