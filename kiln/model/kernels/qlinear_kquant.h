// K-quant weights (GGUF Q4_K / Q5_K / Q6_K) with float activations (qlinear_kquant.cpp) or 8-bit ones
// (qlinear_kquant_q8.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace kiln {

// y = x @ W^T (+ bias) for tiled Q4_K (fmt 0) / Q5_K (1) / Q6_K (2) weights (kiln/model/quant.py's
// layout): x [..., k] -> [..., n] in x's dtype, or float32 with out_float. float_act: x in float32
// (bfloat16 x widened), the dequantized weight's product; else x quantized to int8 per group of 32
// (llama.cpp's arithmetic). isa: -1 active, 0 scalar, 1 avx2, 2 avx512; all three give the same bits.
torch::Tensor qlinear_kquant(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt,
                             int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                             bool out_float, bool float_act = true);

// The 8-bit-activation product of a validated contiguous x [M, K] (qlinear_kquant_q8.cpp).
torch::Tensor qlinear_kquant_q8_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                   int64_t fmt, int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                   bool out_float);

}  // namespace kiln
