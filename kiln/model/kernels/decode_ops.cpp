// Small fused ops of the paged serving path, where torch's per-op overhead outweighs the arithmetic:
//
//   rms_norm(x, w, eps)          one pass per row instead of torch's pow/mean/add/rsqrt/mul chain
//                                (about 50 us per call at decode sizes). Rounds like F.rms_norm: the
//                                normalised row is cast to x's dtype before the weight multiplies it.
//   paged_decode_attention(...)  one query token per sequence against its paged K/V context, read in
//                                place through the slot table: no gather of the context, no padding
//                                mask, softmax in float32. Grouped-query heads share one K/V head.
//
// Both take float32 or bfloat16 tensors and accumulate in float32. Plain loops: the compiler
// vectorises them for the baseline ISA, and the work per call is small.

#include "decode_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float v = to_float(xr[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      const T normed = static_cast<T>(to_float(xr[i]) * inv);   // F.rms_norm: type_as(input) first
      yr[i] = static_cast<T>(to_float(normed) * to_float(w[i]));
    }
  }
}

// out[g, :] = softmax(scale * q[g] . K[l]) @ V[l] over the context l < len, for the `groups` query
// heads that share KV head `hk`. K/V rows live at cache[slot[l], hk, :].
template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* slot, int64_t len, int64_t groups,
            int64_t hk, int64_t hkv, int64_t d, float scale, T* out, std::vector<float>& scores,
            std::vector<float>& qf, std::vector<float>& acc) {
  scores.resize(static_cast<size_t>(len));
  qf.resize(static_cast<size_t>(d));
  acc.resize(static_cast<size_t>(d));
  for (int64_t g = 0; g < groups; ++g) {
    const T* qg = q + g * d;
    for (int64_t i = 0; i < d; ++i) qf[i] = to_float(qg[i]) * scale;
    float mx = -INFINITY;
    for (int64_t l = 0; l < len; ++l) {
      const T* kr = k_cache + (slot[l] * hkv + hk) * d;
      float s = 0.f;
      for (int64_t i = 0; i < d; ++i) s += qf[i] * to_float(kr[i]);
      scores[l] = s;
      mx = std::max(mx, s);
    }
    float sum = 0.f;
    for (int64_t l = 0; l < len; ++l) {
      scores[l] = std::exp(scores[l] - mx);
      sum += scores[l];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t l = 0; l < len; ++l) {
      const T* vr = v_cache + (slot[l] * hkv + hk) * d;
      const float p = scores[l];
      for (int64_t i = 0; i < d; ++i) acc[i] += p * to_float(vr[i]);
    }
    const float inv = 1.f / sum;
    T* og = out + g * d;
    for (int64_t i = 0; i < d; ++i) og[i] = static_cast<T>(acc[i] * inv);
  }
}

template <typename T>
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& slots, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t bd = slots.size(0), lmax = slots.size(1);
  const int64_t hkv = k_cache.size(1), d = k_cache.size(2), heads = q.size(1), groups = heads / hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  at::parallel_for(0, bd * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, hk = task % hkv;
      const int64_t len = std::min(lp[b], lmax);
      attend<T>(qp + b * q_stride + hk * groups * d, kp, vp, sp + b * lmax, len, groups, hk, hkv, d,
                static_cast<float>(scale), op + (b * heads + hk * groups) * d, scores, qf, acc);
    }
  });
}

}  // namespace

namespace kiln {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0) && x.stride(1) == 1 && w.is_contiguous(),
                    "kiln rms_norm: x [T, n] with contiguous rows, w [n]");
  TORCH_CHECK_VALUE(x.scalar_type() == w.scalar_type(), "kiln rms_norm: x and w must share a dtype");
  TORCH_CHECK_VALUE(x.device().is_cpu() && w.device().is_cpu(), "kiln rms_norm: CPU tensors only");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    rms_norm_rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, n, x.stride(0), e);
  } else if (x.scalar_type() == torch::kBFloat16) {
    rms_norm_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(),
                                 y.data_ptr<c10::BFloat16>(), rows, n, x.stride(0), e);
  } else {
    TORCH_CHECK_VALUE(false, "kiln rms_norm: float32 or bfloat16 only");
  }
  return y;
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& lens, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && slots.dim() == 2 &&
                        lens.dim() == 1,
                    "kiln paged_decode_attention: q [B, H, D], caches [N, Hkv, D], slots [B, L], lens [B]");
  TORCH_CHECK_VALUE(q.size(0) == slots.size(0) && lens.size(0) == slots.size(0) && q.size(2) == k_cache.size(2) &&
                        q.size(1) % k_cache.size(1) == 0,
                    "kiln paged_decode_attention: shape mismatch");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                    "kiln paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                        lens.is_contiguous() && q.stride(2) == 1 && q.stride(1) == q.size(2),
                    "kiln paged_decode_attention: contiguous caches, slots and per-token query rows");
  TORCH_CHECK_VALUE(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
                    "kiln paged_decode_attention: int64 slots and lens");
  auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat32) {
    decode_attention<float>(q, k_cache, v_cache, slots, lens, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_attention<c10::BFloat16>(q, k_cache, v_cache, slots, lens, scale, out);
  } else {
    TORCH_CHECK_VALUE(false, "kiln paged_decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace kiln
