// Batched multi-adapter LoRA for the decode and prefill rows of a step (see lora_bgmv.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// out[i] += (x[i] @ a[slots[i]]^T) @ b[slots[i]] for i < len(slots); slot 0 (the base) is skipped.
// isa: -1 best, 0 scalar, 1 avx2, 2 avx512 (capped at what the CPU has).
void lora_bgmv_add(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                   const torch::Tensor& slots, int64_t isa);

}  // namespace kiln
