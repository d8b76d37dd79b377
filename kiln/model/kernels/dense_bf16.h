// bfloat16 linear layers: AVX512-BF16, AVX2 (widened in registers) or scalar (see dense_bf16.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// y [M, n] = x [M, k] @ W^T (+ bias) in bfloat16; accumulates in float32. tiles [ceil(n/16),
// ceil(k/2), 32]: tiles[t, p, 2r + e] = W[16t + r, 2p + e], zero beyond n and k.
// isa: -1 the active level (isa.h), else a level the CPU runs; every path gives the same bits. out_float: float32 output, the sums
// unrounded (the LM head: logits rounded to bfloat16 tie tokens that are not tied).
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t k,
                          const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float);

// The same product for a weight kept as its GGUF codes (kind 0: 4-bit, value bf16(fma(d, c, m)); kind
// 1: int8, bf16(d * c); layout in dense_bf16.cpp): every value rebuilt exactly, so the same bits as
// linear_bf16 over the decoded tiles. k must be a multiple of 32.
torch::Tensor linear_bf16_coded(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                int64_t kind, int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias,
                                int64_t isa, bool out_float);

// The bfloat16 tiles (linear_bf16's layout) a coded weight stands for.
torch::Tensor decode_coded_tiles(const torch::Tensor& codes, const torch::Tensor& scales, int64_t kind, int64_t n,
                                 int64_t k, int64_t isa);

// Whether this CPU has AVX512-BF16 (linear_bf16's fastest path).
bool bf16_dot_supported();

}  // namespace kiln
