// K-quant weights (GGUF Q4_K / Q5_K / Q6_K) with float activations (see qlinear_kquant.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace kiln {

// y = x @ W^T (+ bias) for tiled Q4_K (fmt 0) / Q5_K (1) / Q6_K (2) weights (kiln/model/quant.py's
// layout), x in float32 (bfloat16 x widened): x [..., k] -> [..., n] in x's dtype, or float32 with
// out_float. isa: -1 active, 0 scalar, 1 avx2, 2 avx512; all three give the same bits.
torch::Tensor qlinear_kquant(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt,
                             int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa,
                             bool out_float);

}  // namespace kiln
