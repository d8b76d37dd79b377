// Small fused ops of the paged serving path, where torch's per-op overhead outweighs the arithmetic:
//
//   rms_norm(x, w, eps)          one pass per row instead of torch's pow/mean/add/rsqrt/mul chain
//                                (about 50 us per call at decode sizes). Rounds like F.rms_norm: the
//                                normalised row is cast to x's dtype before the weight multiplies it.
//   paged_attention(...)         query tokens against their paged K/V context, read in place through
//                                the slot table: no gather of the context, no padding mask (each
//                                token has its own length), softmax in float32. The serving path
//                                uses it for decode rows (one query per sequence).
//
//   rope_and_cache(...)          rotary embedding in place on q and k, then k and v written to their
//                                cache slots: one call instead of about a dozen small torch ops.
//
// All take float32 or bfloat16 tensors and accumulate in float32. Attention has an AVX512 path
// (chosen from cpuid, like qlinear.cpp) for head sizes that are multiples of 16.

#include "decode_ops.h"

#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// Row loads as float32 vectors: bf16 widens exactly (a 16-bit shift).
inline const float* as_float_row(const float* src, int64_t, float*) { return src; }
inline const float* as_float_row(const c10::BFloat16* src, int64_t d, float* buf) {
  for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_ATTN_X86 1
#include <immintrin.h>
#define KILN_ATTN_AVX512 __attribute__((target("avx512f,fma")))

bool attn_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

KILN_ATTN_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KILN_ATTN_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// D a multiple of 16 and at most 256: the query and the accumulator stay in registers' reach.
template <typename T>
KILN_ATTN_AVX512 void attend_avx512(const float* qf, const T* k_cache, const T* v_cache, const int64_t* slot,
                                    int64_t len, int64_t hk, int64_t hkv, int64_t d, float* scores, float* out) {
  const int64_t nv = d / 16;
  __m512 q[16];
  for (int64_t v = 0; v < nv; ++v) q[v] = _mm512_loadu_ps(qf + 16 * v);
  float mx = -INFINITY;
  for (int64_t l = 0; l < len; ++l) {
    const T* kr = k_cache + (slot[l] * hkv + hk) * d;
    __m512 acc = _mm512_mul_ps(q[0], load16(kr));
    for (int64_t v = 1; v < nv; ++v) acc = _mm512_fmadd_ps(q[v], load16(kr + 16 * v), acc);
    const float s = _mm512_reduce_add_ps(acc);
    scores[l] = s;
    mx = s > mx ? s : mx;
  }
  float sum = 0.f;
  for (int64_t l = 0; l < len; ++l) {
    scores[l] = std::exp(scores[l] - mx);
    sum += scores[l];
  }
  __m512 acc[16];
  for (int64_t v = 0; v < nv; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    const T* vr = v_cache + (slot[l] * hkv + hk) * d;
    const __m512 p = _mm512_set1_ps(scores[l]);
    for (int64_t v = 0; v < nv; ++v) acc[v] = _mm512_fmadd_ps(p, load16(vr + 16 * v), acc[v]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(acc[v], inv));
}
#endif

template <typename T>
void attend_scalar(const float* qf, const T* k_cache, const T* v_cache, const int64_t* slot, int64_t len,
                   int64_t hk, int64_t hkv, int64_t d, float* scores, float* out, float* row) {
  float mx = -INFINITY;
  for (int64_t l = 0; l < len; ++l) {
    const float* kr = as_float_row(k_cache + (slot[l] * hkv + hk) * d, d, row);
    float s = 0.f;
    for (int64_t i = 0; i < d; ++i) s += qf[i] * kr[i];
    scores[l] = s;
    mx = std::max(mx, s);
  }
  float sum = 0.f;
  for (int64_t l = 0; l < len; ++l) {
    scores[l] = std::exp(scores[l] - mx);
    sum += scores[l];
  }
  std::fill(out, out + d, 0.f);
  for (int64_t l = 0; l < len; ++l) {
    const float* vr = as_float_row(v_cache + (slot[l] * hkv + hk) * d, d, row);
    const float p = scores[l];
    for (int64_t i = 0; i < d; ++i) out[i] += p * vr[i];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

// Query token t attends to positions 0..lens[t]-1 of slot row t: out[t, h] for every head h.
// Tasks are (token, KV head), on the kernels' pool; the query heads of a KV head reuse the K/V rows
// while they are in cache.
template <typename T>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& slots, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t tokens = q.size(0), lmax = slots.size(1);
  const int64_t hkv = k_cache.size(1), d = k_cache.size(2), heads = q.size(1), groups = heads / hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  const float sc = static_cast<float>(scale);
#ifdef KILN_ATTN_X86
  const bool vec = attn_avx512() && d % 16 == 0 && d <= 256;
#else
  const bool vec = false;
#endif
  kiln::parallel_tasks(tokens * hkv, [&](int64_t task) {
    thread_local std::vector<float> scores, qf, res, row;
    scores.resize(static_cast<size_t>(lmax));
    qf.resize(static_cast<size_t>(d));
    res.resize(static_cast<size_t>(d));
    row.resize(static_cast<size_t>(d));
    const int64_t t = task / hkv, hk = task % hkv;
    const int64_t len = std::min(lp[t], lmax);
    const int64_t* slot = sp + t * lmax;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t h = hk * groups + g;
      const T* qh = qp + t * q_stride + h * d;
      for (int64_t i = 0; i < d; ++i) qf[i] = static_cast<float>(qh[i]) * sc;
      if (len <= 0) {
        std::fill(res.begin(), res.end(), 0.f);
      } else {
#ifdef KILN_ATTN_X86
        if (vec) {
          attend_avx512<T>(qf.data(), kp, vp, slot, len, hk, hkv, d, scores.data(), res.data());
        } else
#endif
        {
          attend_scalar<T>(qf.data(), kp, vp, slot, len, hk, hkv, d, scores.data(), res.data(), row.data());
        }
      }
      T* oh = op + (t * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) oh[i] = static_cast<T>(res[i]);
    }
  });
}

// Rotary embedding in place on rows [T, H, D] (cos/sin_signed [T, D] per token, rotate-half form:
// x*cos + roll(x, D/2)*sin_signed), rounded like torch's mul-then-addcmul.
template <typename T>
void rope_rows(T* x, int64_t tokens, int64_t heads, int64_t d, const T* cos, const T* sin, int64_t cs_stride,
               std::vector<float>& buf) {
  const int64_t half = d / 2;
  buf.resize(static_cast<size_t>(d));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * cs_stride;
    const T* sn = sin + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + (t * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(row[i]);
      for (int64_t i = 0; i < d; ++i) {
        const float rolled = buf[i < half ? i + half : i - half];
        const float xc = static_cast<float>(static_cast<T>(buf[i] * static_cast<float>(c[i])));
        row[i] = static_cast<T>(xc + rolled * static_cast<float>(sn[i]));
      }
    }
  }
}

template <typename T>
void write_rows(const T* src, T* cache, const int64_t* slots, int64_t tokens, int64_t row) {
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(cache + slots[t] * row, src + t * row, sizeof(T) * row);
}

}  // namespace

namespace kiln {

void rope_and_cache(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const torch::Tensor& cos,
                    const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                    const torch::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 &&
                        v_cache.sizes() == k_cache.sizes() && k.size(1) == k_cache.size(1) &&
                        k.size(2) == k_cache.size(2) && q.size(2) == k.size(2) && q.size(0) == k.size(0),
                    "kiln rope_and_cache: q [T, H, D], k and v [T, Hkv, D], caches [N, Hkv, D]");
  TORCH_CHECK_VALUE(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous() && slot_mapping.is_contiguous(),
                    "kiln rope_and_cache: contiguous tensors only");
  const auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(k.scalar_type() == dt && v.scalar_type() == dt && k_cache.scalar_type() == dt &&
                        v_cache.scalar_type() == dt && cos.scalar_type() == dt && sin.scalar_type() == dt,
                    "kiln rope_and_cache: one dtype for q, k, v, the caches and the rotary tables");
  const int64_t tokens = q.size(0), d = q.size(2);
  TORCH_CHECK_VALUE(cos.numel() == tokens * d && sin.numel() == tokens * d && cos.is_contiguous() &&
                        sin.is_contiguous() && d % 2 == 0,
                    "kiln rope_and_cache: cos and sin hold one row of head_dim per token");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == tokens,
                    "kiln rope_and_cache: one int64 slot per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n_slots = k_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < n_slots, "kiln rope_and_cache: slot ", slots[t], " out of range");
  const int64_t row = k.size(1) * d;
  std::vector<float> buf;
  if (dt == torch::kFloat32) {
    rope_rows<float>(q.data_ptr<float>(), tokens, q.size(1), d, cos.data_ptr<float>(), sin.data_ptr<float>(), d, buf);
    rope_rows<float>(k.data_ptr<float>(), tokens, k.size(1), d, cos.data_ptr<float>(), sin.data_ptr<float>(), d, buf);
    write_rows<float>(k.data_ptr<float>(), k_cache.data_ptr<float>(), slots, tokens, row);
    write_rows<float>(v.data_ptr<float>(), v_cache.data_ptr<float>(), slots, tokens, row);
  } else if (dt == torch::kBFloat16) {
    using B = c10::BFloat16;
    rope_rows<B>(q.data_ptr<B>(), tokens, q.size(1), d, cos.data_ptr<B>(), sin.data_ptr<B>(), d, buf);
    rope_rows<B>(k.data_ptr<B>(), tokens, k.size(1), d, cos.data_ptr<B>(), sin.data_ptr<B>(), d, buf);
    write_rows<B>(k.data_ptr<B>(), k_cache.data_ptr<B>(), slots, tokens, row);
    write_rows<B>(v.data_ptr<B>(), v_cache.data_ptr<B>(), slots, tokens, row);
  } else {
    TORCH_CHECK_VALUE(false, "kiln rope_and_cache: float32 or bfloat16 only");
  }
}


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

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& slots, const torch::Tensor& lens, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && slots.dim() == 2 &&
                        lens.dim() == 1,
                    "kiln paged_attention: q [T, H, D], caches [N, Hkv, D], slots [T, L], lens [T]");
  TORCH_CHECK_VALUE(slots.size(0) == q.size(0) && lens.size(0) == q.size(0) && q.size(2) == k_cache.size(2) &&
                        q.size(1) % k_cache.size(1) == 0,
                    "kiln paged_attention: shape mismatch");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
                    "kiln paged_attention: q and the caches must share a dtype");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                        lens.is_contiguous() && q.stride(2) == 1 && q.stride(1) == q.size(2),
                    "kiln paged_attention: contiguous caches, slots and per-token query rows");
  TORCH_CHECK_VALUE(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
                    "kiln paged_attention: int64 slots and lens");
  auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat32) {
    paged_attention_impl<float>(q, k_cache, v_cache, slots, lens, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    paged_attention_impl<c10::BFloat16>(q, k_cache, v_cache, slots, lens, scale, out);
  } else {
    TORCH_CHECK_VALUE(false, "kiln paged_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace kiln
