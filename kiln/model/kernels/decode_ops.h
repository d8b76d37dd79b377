// Fused ops of the paged decode path (see decode_ops.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// y = F.rms_norm(x, [n], w, eps) for x [T, n] (float32 / bfloat16).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// One query token per sequence against its paged context: q [B, H, D], caches [N, Hkv, D],
// slots [B, L] (cache rows of positions 0..L-1), lens [B] -> out [B, H * D].
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& lens, double scale);

}  // namespace kiln
