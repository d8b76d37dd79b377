// Fused ops of the paged decode path (see decode_ops.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// y = F.rms_norm(x, [n], w, eps) for x [T, n] (float32 / bfloat16).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// Query tokens against their paged context: q [T, H, D], caches [N, Hkv, D], slots [T, L] (cache
// rows of positions 0..L-1 of each token's sequence), lens [T] (how many positions each token
// sees) -> out [T, H * D].
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& slots, const torch::Tensor& lens, double scale);

// h += delta in place, rounded as at::add rounds (contiguous tensors of one shape, float32 / bfloat16).
void add_inplace(torch::Tensor h, const torch::Tensor& delta);

// Rotary embedding in place on q [T, H, D] and k [T, Hkv, D] (cos, sin_signed: [T, D] rows, the
// rotate-half form), then k and v stored at cache rows slot_mapping [T]. Each token's [H, D] must be
// dense; tokens may be any stride apart (views into one fused q|k|v output).
void rope_and_cache(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const torch::Tensor& cos,
                    const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                    const torch::Tensor& slot_mapping);

// Greedy rows: (the first index of each row's max [B] int64, its log-softmax [B] float32) for float32
// logits [B, V], as torch.log_softmax + argmax + gather pick them (up to float32 rounding).
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits);

}  // namespace kiln
