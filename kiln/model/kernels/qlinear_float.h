// Quantized weights with float activations (see qlinear_float.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace kiln {

// y = x @ W^T (+ bias) for qlinear's tiled q4_1 (kind 0) / q8_0 (kind 1) weights, x in float32 (bfloat16
// x widened): x [..., k] -> [..., n] in x's dtype, or float32 with out_float. isa: -1 active, 0 scalar,
// 1 avx2, 2 avx512; all three give the same bits.
torch::Tensor qlinear_float(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                            int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                            bool out_float);

}  // namespace kiln
