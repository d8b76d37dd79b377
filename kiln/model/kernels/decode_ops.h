// Fused ops of the paged decode path (see decode_ops.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// y = F.rms_norm(x, [n], w, eps) for x [T, n] (float32 / bfloat16).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// Query tokens against their paged context: q [T, H, D], caches [N, Hkv, D], slots [R, L] (cache
// rows of positions 0..L-1 per sequence), rows [T] (the slot row of each token), lens [T] (how many
// positions each token sees) -> out [T, H * D].
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& slots, const torch::Tensor& rows, const torch::Tensor& lens,
                              double scale);

}  // namespace kiln
