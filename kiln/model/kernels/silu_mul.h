// silu(gate) * up with the same bits at every position of every row (see silu_mul.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// silu(gate) * up for gate, up [T, n] (float32 / bfloat16, contiguous rows at any row stride) ->
// a new contiguous [T, n]. Rounds as F.silu(gate) * up rounds: silu to the dtype, then the product.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace kiln
