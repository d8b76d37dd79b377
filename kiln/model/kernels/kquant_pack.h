// The K-quant tiles' codec: GGUF blocks into tiles (kquant_pack.cpp), tiles into dense weights
// (kquant_dequant.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace kiln {

// blocks: uint8, the GGUF blocks of a [rows, k] tensor (row-major, k / 256 superblocks a row); fmt 0 Q4_K,
// 1 Q5_K, 2 Q6_K; rows: the source rows to keep, in order (n of them), else all n; perm: kquant.py's byte
// permutation of a tile's superblock (16 * record bytes entries). Returns (qs [T, S, super_bytes],
// scales [T, S, rest]); rows past n are zero. out_qs / out_scales: contiguous tensors of those shapes to
// write into and return (a fused weight's slice of tiles), else new ones.
std::vector<torch::Tensor> kquant_tiles_from_gguf(const torch::Tensor& blocks, int64_t fmt, int64_t n, int64_t k,
                                                  const c10::optional<torch::Tensor>& rows, const torch::Tensor& perm,
                                                  int64_t super_bytes, const c10::optional<torch::Tensor>& out_qs,
                                                  const c10::optional<torch::Tensor>& out_scales);

// The dense [n, k] weight of kquant tiles (float32, or bfloat16 rounded from it), each value as
// gguf.quants.dequantize computes it; every ISA gives the same bits. isa: -1 the active one, 0 scalar,
// 1 avx2, 2 avx512. out: n * k contiguous values of that dtype to write into (a reused buffer spares
// the fresh pages a new tensor of that size faults in); returned. torch_threads: share the tiles out on
// torch's intra-op threads (a training step's, whose matmuls run on them between the dequantizations)
// instead of the kernels' own pool.
torch::Tensor kquant_dequantize(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                int64_t k, bool bf16, int64_t isa, const c10::optional<torch::Tensor>& out,
                                bool torch_threads);

// The columns k0:k1 (whole superblocks) of the same weight, transposed: [k1 - k0, n], row i holding
// column k0 + i of every output row, with kquant_dequantize's values and bits.
torch::Tensor kquant_dequantize_t(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                  int64_t k, int64_t k0, int64_t k1, bool bf16, int64_t isa,
                                  const c10::optional<torch::Tensor>& out, bool torch_threads);

// The format fmt (0 Q4_K, 1 Q5_K, 2 Q6_K) of tiles (qs, scales) for an [n, k] weight, checked against what
// they hold; a ValueError naming `what` otherwise.
int kquant_checked_format(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n, int64_t k,
                          const char* what);

// One superblock of one tile as bfloat16 bits: its `rows` (<= 16) rows of 256 values, row r at out + 256 r,
// kquant_dequantize's values. qs / sc: that superblock's records; isa: a resolved level.
void kquant_decode_superblock(int fmt, int64_t isa, const uint8_t* qs, const uint8_t* sc, int64_t rows, uint16_t* out);

// grad @ W for the same weight's bfloat16 values (kquant_input_grad.cpp): grad [M, n] float32 -> [M, k]
// float32, each output one chain of fused multiply-adds over W's rows in order, the same bits on every ISA
// and thread count. The backward's input gradient on a CPU without bfloat16 dot products. isa as above;
// runs on torch's intra-op threads.
torch::Tensor kquant_input_grad(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                int64_t k, const torch::Tensor& grad, int64_t isa);

}  // namespace kiln
