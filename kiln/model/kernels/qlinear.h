// Quantized linear layers for small M (see qlinear.cpp).
#pragma once

#include <torch/extension.h>

namespace kiln {

// y = x @ W^T (+ bias) for tiled q4_1 (kind 0) / q8_0 (kind 1) weights; x [..., k] -> [..., n] in x's
// dtype. isa: -1 best, 0 scalar, 1 avx2, 2 avx512-vnni.
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales, int64_t kind,
                      int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa);

// fn(ctx, c) for every c in [0, n) on the calling thread and the kernels' own pool (the one qlinear
// uses): a decode step's kernels share one set of threads instead of waking OpenMP's as well, whose
// spinning workers would compete with the pool's for the same cores.
void parallel_chunks(int64_t n, void (*fn)(const void*, int64_t), const void* ctx);

template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  parallel_chunks(n, [](const void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); }, &f);
}

}  // namespace kiln
