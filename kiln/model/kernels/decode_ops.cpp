// Small fused ops of the paged serving path, where torch's per-op overhead outweighs the arithmetic:
//
//   rms_norm(x, w, eps)          one pass per row instead of torch's pow/mean/add/rsqrt/mul chain
//                                (about 50 us per call at decode sizes). Rounds like F.rms_norm: the
//                                normalised row is cast to x's dtype before the weight multiplies it.
//   paged_attention(...)         query tokens against their paged K/V context, read in place through
//                                the slot table: no gather of the context, no padding mask (each
//                                token has its own length), softmax in float32. The serving path
//                                uses it for decode rows (one query per sequence) and, on the AVX512
//                                path, for prompt chunks too (their tokens share one slot row: a
//                                row stride of 0). A token's output depends only on its query, its
//                                length and the K/V rows it reads, so a prompt gives the same bits
//                                however it is chunked or batched.
//
//   rope_and_cache(...)          rotary embedding in place on q and k, then k and v written to their
//                                cache slots: one call instead of about a dozen small torch ops.
//
// All take float32 or bfloat16 tensors and accumulate in float32. Attention has an AVX512 path
// (chosen from cpuid, like qlinear.cpp) for head sizes that are multiples of 16: scores 16 positions
// at a time (one transposing reduction instead of one per position; bf16 dot products with
// vdpbf16ps where the CPU has them), a vectorised exp, and long contexts cut into splits that run
// as separate tasks and combine in order (see split_count).

#include "decode_ops.h"

#include "bf16_simd.h"
#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// Elements per task of the row-wise ops (norm, residual add, rotary): a 32-row decode step's are
// tens of microseconds each on one thread, worth the kernels' pool from a few rows up. A row's
// values are computed as on one thread, so no bit depends on the split.
constexpr int64_t kElementwiseGrain = 4096;

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// The sum of squares of a row as 16 partial sums (element i into sum i % 16), combined by a fixed
// tree: the vector path below computes exactly these operations, so both give the same bits; one
// serial chain of n adds cost a decode step more than the rest of the norm.
constexpr int kNormLanes = 16;

template <typename T>
float sum_squares_scalar(const T* x, int64_t n) {
  float acc[kNormLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    acc[i % kNormLanes] += v * v;
  }
  float s8[8], s4[4];
  for (int j = 0; j < 8; ++j) s8[j] = acc[j] + acc[j + 8];
  for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    const float inv = 1.f / std::sqrt(sum_squares_scalar(xr, n) / static_cast<float>(n) + eps);
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

// ---- paged attention ----
// A token's context is cut into splits of whole 16-position blocks (flash-decoding): a split yields,
// per query head, the max m of its scores, the sum l of exp(s - m) and the unnormalised output
// sum exp(s - m) v; the splits then combine in order. The splits follow from the token's length
// alone, so its bits never depend on the batch it shares or on the thread count. From 4 blocks up
// they come in pairs of at most kSplitBlocks blocks each: one token alone keeps two threads busy.
constexpr int64_t kBlock = 16;
constexpr int64_t kSplitBlocks = 32;
constexpr int64_t kSplitMax = kBlock * kSplitBlocks;

inline int64_t split_count(int64_t len) {
  const int64_t blocks = (len + kBlock - 1) / kBlock;
  if (blocks < 4) return 1;
  return 2 * ((blocks + 2 * kSplitBlocks - 1) / (2 * kSplitBlocks));
}

// First position of split i of n (i == n gives len): whole blocks, as even as they come.
inline int64_t split_begin(int64_t len, int64_t n, int64_t i) {
  const int64_t blocks = (len + kBlock - 1) / kBlock;
  return std::min(len, kBlock * (i * blocks / n));
}

// A split's record for the `groups` query heads of one KV head: m[groups], l[groups], acc[groups][d].
inline int64_t record_size(int64_t groups, int64_t d) { return groups * (d + 2); }

// Positions 0..n-1 of `slot` for the query heads of KV head hk; scalar (any head size, any ISA).
template <typename T>
void split_scalar(const T* qh, float sc, const T* k_cache, const T* v_cache, const int64_t* slot, int64_t n,
                  int64_t hk, int64_t hkv, int64_t d, int64_t groups, float* rec) {
  thread_local std::vector<float> qf, row;
  qf.resize(static_cast<size_t>(d));
  row.resize(static_cast<size_t>(d));
  float s[kSplitMax];
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t i = 0; i < d; ++i) qf[i] = static_cast<float>(qh[g * d + i]) * sc;
    float mx = -INFINITY;
    for (int64_t l = 0; l < n; ++l) {
      const float* kr = as_float_row(k_cache + (slot[l] * hkv + hk) * d, d, row.data());
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += qf[i] * kr[i];
      s[l] = acc;
      mx = std::max(mx, acc);
    }
    float sum = 0.f;
    for (int64_t l = 0; l < n; ++l) {
      s[l] = std::exp(s[l] - mx);
      sum += s[l];
    }
    float* acc = rec + 2 * groups + g * d;
    std::fill(acc, acc + d, 0.f);
    for (int64_t l = 0; l < n; ++l) {
      const float* vr = as_float_row(v_cache + (slot[l] * hkv + hk) * d, d, row.data());
      for (int64_t i = 0; i < d; ++i) acc[i] += s[l] * vr[i];
    }
    rec[g] = mx;
    rec[groups + g] = sum;
  }
}

// out[g] = the splits' outputs weighted by exp(m_s - max m), over the same weighting of their sums;
// in split order, so the bits never depend on which thread finished last.
template <typename T>
void combine_splits(const float* recs, int64_t splits, int64_t groups, int64_t d, T* out) {
  const int64_t size = record_size(groups, d);
  thread_local std::vector<float> o;
  o.resize(static_cast<size_t>(d));
  for (int64_t g = 0; g < groups; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, recs[s * size + g]);
    float sum = 0.f;
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* r = recs + s * size;
      const float w = std::exp(r[g] - mx);
      sum += w * r[groups + g];
      const float* acc = r + 2 * groups + g * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * acc[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<T>(o[i] * inv);
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_ATTN_X86 1
#include <immintrin.h>
#define KILN_ATTN_AVX512 __attribute__((target("avx512f,fma")))
#define KILN_ATTN_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

// The AVX512 path at the active ISA level; bf16 dot products from the cache rows (vdpbf16ps: exact
// products, float32 sums) where the CPU has them.
bool attn_avx512(int64_t isa) { return isa >= kiln::ISA_AVX512; }
bool attn_bf16_dot(int64_t isa) { return attn_avx512(isa) && kiln::cpu_has_avx512_bf16(); }

constexpr int kMaxNV = 16;   // head_dim up to 256 on the vector path

KILN_ATTN_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// A row as nv float32 vectors. bf16 widens 32 values at a time into an (even, odd) pair of vectors,
// one shift or mask per 16 values; queries and outputs use the same lane order (layout_of).
KILN_ATTN_AVX512 inline void load_row(const float* p, int nv, __m512* r) {
  for (int v = 0; v < nv; ++v) r[v] = _mm512_loadu_ps(p + 16 * v);
}
KILN_ATTN_AVX512 inline void load_row(const c10::BFloat16* p, int nv, __m512* r) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int v = 0;
  for (; v + 2 <= nv; v += 2) {
    const __m512i w = _mm512_loadu_si512(p + 16 * v);
    r[v] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    r[v + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
  }
  if (v < nv) r[v] = load16(p + 16 * v);
}

// Where element i of a row lands in load_row's vectors (vector * 16 + lane).
template <typename T>
inline int64_t layout_of(int64_t i, int64_t nv) {
  if (std::is_same<T, float>::value || i >= (nv / 2) * 32) return i;
  const int64_t c = i / 32, r = i % 32;
  return (2 * c + (r & 1)) * 16 + (r >> 1);
}

// Lane p of the result = the sum of the 16 lanes of a[4 * (p % 4) + p / 4]: a transposing tree of
// 15 adds for 16 dot products instead of one horizontal reduction each.
KILN_ATTN_AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

// exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial, about 1e-7 relative; NaN
// passes through.
KILN_ATTN_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.f), x);   // max(c, NaN) is NaN; exp(-110) is 0 in float
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 lanes_below(int64_t m) {
  return m >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << m) - 1);
}

// Cache rows are gathered through the slot table, so the hardware prefetcher loses the stream at
// every block: ask for the rows kAheadRows positions ahead (a decode step reads more K/V than weights
// once a few dozen sequences have a few hundred positions each).
constexpr int64_t kAheadRows = 16;
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* slot, int64_t l0, int64_t l1, int64_t hk, int64_t hkv,
                          int64_t d) {
  for (int64_t l = l0; l < l1; ++l) {
    const char* r = reinterpret_cast<const char*>(cache + (slot[l] * hkv + hk) * d);
    for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
  }
}

// The 16 rows of the block at b (the last row repeated past n), in reduce16's order.
template <typename T>
inline void block_rows(const T* cache, const int64_t* slot, int64_t b, int64_t n, int64_t hk, int64_t hkv,
                       int64_t d, const T** rows) {
  const int64_t last = n - 1 - b;
  for (int j = 0; j < 16; ++j) {
    const int64_t p = 4 * (j % 4) + j / 4;
    rows[j] = cache + (slot[b + std::min<int64_t>(p, last)] * hkv + hk) * d;
  }
}

// Scores of positions 0..n-1 for hb queries (q: hb rows in load_row's layout, already scaled) into
// s[h * kSplitMax + l]; lanes past n in the last block are -inf.
template <typename T, int NV>
KILN_ATTN_AVX512 void qk_fma(const float* q, int64_t hb, int nv_rt, const T* k_cache, const int64_t* slot, int64_t n,
                             int64_t hk, int64_t hkv, int64_t d, float* s) {
  const int nv = NV > 0 ? NV : nv_rt;
  for (int64_t b = 0; b < n; b += 16) {
    const T* rows[16];
    block_rows(k_cache, slot, b, n, hk, hkv, d, rows);
    prefetch_rows(k_cache, slot, b + kAheadRows, std::min<int64_t>(n, b + kAheadRows + 16), hk, hkv, d);
    const __mmask16 valid = lanes_below(n - b);
    for (int64_t h = 0; h < hb; ++h) {
      __m512 qv[kMaxNV];
      for (int v = 0; v < nv; ++v) qv[v] = _mm512_loadu_ps(q + (h * nv + v) * 16);
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        __m512 k[kMaxNV];
        load_row(rows[j], nv, k);
        a[j] = _mm512_mul_ps(qv[0], k[0]);
        for (int v = 1; v < nv; ++v) a[j] = _mm512_fmadd_ps(qv[v], k[v], a[j]);
      }
      _mm512_storeu_ps(s + h * kSplitMax + b, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, reduce16(a)));
    }
  }
}

// qk_fma for bf16 with d a multiple of 32, q as it is (hb rows of d) and the scale applied to the sums.
template <int NC>
KILN_ATTN_BF16 void qk_bf16(const c10::BFloat16* q, float sc, int64_t hb, int nc_rt, const c10::BFloat16* k_cache,
                            const int64_t* slot, int64_t n, int64_t hk, int64_t hkv, int64_t d, float* s) {
  const int nc = NC > 0 ? NC : nc_rt;
  const __m512 scale = _mm512_set1_ps(sc);
  for (int64_t b = 0; b < n; b += 16) {
    const c10::BFloat16* rows[16];
    block_rows(k_cache, slot, b, n, hk, hkv, d, rows);
    prefetch_rows(k_cache, slot, b + kAheadRows, std::min<int64_t>(n, b + kAheadRows + 16), hk, hkv, d);
    const __mmask16 valid = lanes_below(n - b);
    for (int64_t h = 0; h < hb; ++h) {
      __m512i qv[kMaxNV / 2];
      for (int c = 0; c < nc; ++c) qv[c] = _mm512_loadu_si512(q + h * d + 32 * c);
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        a[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qv[0], (__m512bh)_mm512_loadu_si512(rows[j]));
        for (int c = 1; c < nc; ++c)
          a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c));
      }
      const __m512 r = _mm512_mul_ps(reduce16(a), scale);
      _mm512_storeu_ps(s + h * kSplitMax + b, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, r));
    }
  }
}

// Query heads sharing one pass over V: their accumulators stay in registers.
constexpr int heads_per_pass(int nv) { return nv <= 0 ? 1 : nv >= 16 ? 1 : 16 / nv >= 4 ? 4 : 16 / nv; }

// Softmax of the hb score rows in place (p = exp(s - m), 0 past n): m and l of heads g0.. in rec.
template <int HB>
KILN_ATTN_AVX512 void softmax_rows(float* s, int64_t hb, int64_t n, int64_t groups, int64_t g0, float* rec) {
  float mh[HB];   // all maxima first: the heads' reductions overlap
  for (int64_t h = 0; h < hb; ++h) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < n; b += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + h * kSplitMax + b));
    mh[h] = _mm512_reduce_max_ps(mx);
  }
  for (int64_t h = 0; h < hb; ++h) {
    float* sh = s + h * kSplitMax;
    const float m = mh[h];
    __m512 sum = _mm512_setzero_ps();
    for (int64_t b = 0; b < n; b += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + b), _mm512_set1_ps(m)));
      const __m512 p = _mm512_maskz_mov_ps(lanes_below(n - b), e);
      _mm512_storeu_ps(sh + b, p);
      sum = _mm512_add_ps(sum, p);
    }
    rec[g0 + h] = m;
    rec[groups + g0 + h] = _mm512_reduce_add_ps(sum);
  }
}

// The hb heads' outputs over V (p in s): acc of heads g0..g0+hb-1 in rec, in load_row's lane order.
template <typename T, int NV>
KILN_ATTN_AVX512 void pv_fma(const float* s, int64_t hb, int nv_rt, const T* v_cache, const int64_t* slot, int64_t n,
                             int64_t hk, int64_t hkv, int64_t d, int64_t groups, int64_t g0, float* rec) {
  constexpr int HB = heads_per_pass(NV);
  const int nv = NV > 0 ? NV : nv_rt;
  __m512 acc[HB][kMaxNV];
  for (int h = 0; h < HB; ++h)
    for (int v = 0; v < nv; ++v) acc[h][v] = _mm512_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    __m512 vr[kMaxNV];
    if (l + kAheadRows < n) prefetch_rows(v_cache, slot, l + kAheadRows, l + kAheadRows + 1, hk, hkv, d);
    load_row(v_cache + (slot[l] * hkv + hk) * d, nv, vr);
    for (int h = 0; h < HB; ++h) {
      if (h >= hb) break;
      const __m512 p = _mm512_set1_ps(s[h * kSplitMax + l]);
      for (int v = 0; v < nv; ++v) acc[h][v] = _mm512_fmadd_ps(p, vr[v], acc[h][v]);
    }
  }
  for (int64_t h = 0; h < hb; ++h)   // in load_row's lane order: combine_splits puts it right
    for (int v = 0; v < nv; ++v) _mm512_storeu_ps(rec + 2 * groups + (g0 + h) * d + 16 * v, acc[h][v]);
}

// A row's float32 vectors (load_row's lane order) times inv, stored in T as the scalar cast rounds.
KILN_ATTN_AVX512 inline void store_row(float* p, int nv, const __m512* o, __m512 inv) {
  for (int v = 0; v < nv; ++v) _mm512_storeu_ps(p + 16 * v, _mm512_mul_ps(o[v], inv));
}
KILN_ATTN_AVX512 inline void store_row(c10::BFloat16* p, int nv, const __m512* o, __m512 inv) {
  int v = 0;
  for (; v + 2 <= nv; v += 2) {   // an (even, odd) pair interleaves back into 32 values in order
    const __m512i even = kiln::bf16_bits16(_mm512_mul_ps(o[v], inv)), odd = kiln::bf16_bits16(_mm512_mul_ps(o[v + 1], inv));
    _mm512_storeu_si512(p + 16 * v, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
  }
  if (v < nv) {
    const __m256i last = _mm512_cvtepi32_epi16(kiln::bf16_bits16(_mm512_mul_ps(o[v], inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * v), last);
  }
}

// combine_splits on AVX512, for records in load_row's lane order.
template <typename T>
KILN_ATTN_AVX512 void combine_avx512(const float* recs, int64_t splits, int64_t groups, int64_t d, T* out) {
  const int nv = static_cast<int>(d / 16);
  const int64_t size = record_size(groups, d);
  for (int64_t g = 0; g < groups; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, recs[s * size + g]);
    __m512 o[kMaxNV];
    for (int v = 0; v < nv; ++v) o[v] = _mm512_setzero_ps();
    float sum = 0.f;
    for (int64_t s = 0; s < splits; ++s) {
      const float* r = recs + s * size;
      const float w = std::exp(r[g] - mx);
      sum += w * r[groups + g];
      const __m512 wv = _mm512_set1_ps(w);
      const float* acc = r + 2 * groups + g * d;
      for (int v = 0; v < nv; ++v) o[v] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(acc + 16 * v), o[v]);
    }
    store_row(out + g * d, nv, o, _mm512_set1_ps(1.f / sum));
  }
}

// split_scalar on AVX512, d a multiple of 16 up to 256 (NV = d / 16, or 0: read from d).
template <typename T, int NV>
KILN_ATTN_AVX512 void split_avx512(const T* qh, float sc, const T* k_cache, const T* v_cache, const int64_t* slot,
                                   int64_t n, int64_t hk, int64_t hkv, int64_t d, int64_t groups, bool bf16_dot,
                                   float* rec) {
  constexpr int HB = heads_per_pass(NV);
  const int nv = static_cast<int>(d / 16);
  float s[HB * kSplitMax];
  float q[HB * 16 * kMaxNV];
  for (int64_t g0 = 0; g0 < groups; g0 += HB) {
    const int64_t hb = std::min<int64_t>(HB, groups - g0);
    const T* qg = qh + g0 * d;
    // each pass asks for rows kAheadRows ahead of itself: ask for the first ones of both now
    prefetch_rows(k_cache, slot, 0, std::min<int64_t>(n, kAheadRows), hk, hkv, d);
    prefetch_rows(v_cache, slot, 0, std::min<int64_t>(n, kAheadRows), hk, hkv, d);
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      if (bf16_dot) {
        switch (nv) {
          case 2: qk_bf16<1>(qg, sc, hb, 1, k_cache, slot, n, hk, hkv, d, s); break;
          case 4: qk_bf16<2>(qg, sc, hb, 2, k_cache, slot, n, hk, hkv, d, s); break;
          case 8: qk_bf16<4>(qg, sc, hb, 4, k_cache, slot, n, hk, hkv, d, s); break;
          default: qk_bf16<0>(qg, sc, hb, nv / 2, k_cache, slot, n, hk, hkv, d, s); break;
        }
        softmax_rows<HB>(s, hb, n, groups, g0, rec);
        pv_fma<T, NV>(s, hb, nv, v_cache, slot, n, hk, hkv, d, groups, g0, rec);
        continue;
      }
    }
    for (int64_t h = 0; h < hb; ++h)
      for (int64_t i = 0; i < d; ++i) q[h * d + layout_of<T>(i, nv)] = static_cast<float>(qg[h * d + i]) * sc;
    qk_fma<T, NV>(q, hb, nv, k_cache, slot, n, hk, hkv, d, s);
    softmax_rows<HB>(s, hb, n, groups, g0, rec);
    pv_fma<T, NV>(s, hb, nv, v_cache, slot, n, hk, hkv, d, groups, g0, rec);
  }
}

template <typename T>
void split_vector(const T* qh, float sc, const T* k_cache, const T* v_cache, const int64_t* slot, int64_t n,
                  int64_t hk, int64_t hkv, int64_t d, int64_t groups, bool bf16_dot, float* rec) {
  switch (d) {
    case 32: split_avx512<T, 2>(qh, sc, k_cache, v_cache, slot, n, hk, hkv, d, groups, bf16_dot, rec); break;
    case 64: split_avx512<T, 4>(qh, sc, k_cache, v_cache, slot, n, hk, hkv, d, groups, bf16_dot, rec); break;
    case 128: split_avx512<T, 8>(qh, sc, k_cache, v_cache, slot, n, hk, hkv, d, groups, bf16_dot, rec); break;
    default: split_avx512<T, 0>(qh, sc, k_cache, v_cache, slot, n, hk, hkv, d, groups, bf16_dot, rec); break;
  }
}

// ---- AVX2 (+FMA) ----
// The same splits and records as the other paths (so a token's bits depend on its length alone),
// 8 positions at a time: each position's dot product accumulates in its own ymm over the head's
// 16-value chunks, and one transposing reduction turns the 8 into a vector of 8 scores. bfloat16
// rows widen in registers (a chunk of 16 becomes its even and its odd elements, one shift or mask
// each); the query and the output accumulators use that order, and the output is put back in order
// when the record is written. Records are in natural order: the scalar combine_splits joins splits.
// The query heads of a KV head (a GQA group) share every widened K and V row, up to 3 heads per
// pass: widening each row once per head instead cost a sixth of a 32-row AVX2 attention call.
#define KILN_ATTN_AVX2 __attribute__((target("avx2,fma")))
// the most splits combine_avx2 takes (a longer context, past 32 K positions, combines in scalar code)
constexpr int64_t kMaxSplitsAvx2 = 64;

// the 8-lane pieces of 16 values of a row: (even, odd) elements for bf16, (first 8, last 8) for float
KILN_ATTN_AVX2 inline void chunk16(const c10::BFloat16* p, __m256& a, __m256& b) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
KILN_ATTN_AVX2 inline void chunk16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
// Lane j of the result = the sum of the 8 lanes of a[j].
KILN_ATTN_AVX2 inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0 as exp16 computes it (Cephes' polynomial); below -87 the result is about 1e-38
// instead of smaller (every caller masks or adds it to a sum of at least 1). NaN passes through.
KILN_ATTN_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);   // max(c, NaN) is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

KILN_ATTN_AVX2 inline __m256 lanes_below8(int64_t m) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(m, 8))), idx));
}

// Scores of the 8 positions of a block for GB query heads (q: their rows in chunk16's order, already
// scaled), into s[g * ss + b]. Each K row widens once for all GB heads (a GQA group reads one K head):
// positions go 4 at a time, so 4 * GB accumulators (at most 12) stay in registers; every score is
// still one chain over the chunks in order and one reduce8, so the bits do not depend on GB.
template <typename T, int GB>
KILN_ATTN_AVX2 void qk_block_avx2(const float* q, int64_t d, const T* const* rows, __m256 valid, float* s,
                                  int64_t ss, int64_t b) {
  const int64_t nc = d / 16;
  __m256 part[GB][8];
  for (int h = 0; h < 2; ++h) {
    __m256 a[GB][4];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nc; ++c) {
      for (int j = 0; j < 4; ++j) {
        __m256 k0, k1;
        chunk16(rows[4 * h + j] + 16 * c, k0, k1);
        for (int g = 0; g < GB; ++g) {
          const float* qg = q + g * d + 16 * c;
          a[g][j] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qg + 8), _mm256_fmadd_ps(k0, _mm256_loadu_ps(qg), a[g][j]));
        }
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 4; ++j) part[g][4 * h + j] = a[g][j];
  }
  for (int g = 0; g < GB; ++g)
    _mm256_storeu_ps(s + g * ss + b, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), reduce8(part[g]), valid));
}

// Outputs of GB heads over V (their probabilities p in s[g * ss + l]) for CN 16-value chunks of a head
// from c0 (2 * CN accumulators per head): each V row widens once for the GB heads. out[g * d + 16c +
// lane] in chunk16's order; every accumulator is one chain over the positions in order.
template <typename T, int GB, int CN>
KILN_ATTN_AVX2 void pv_chunks_avx2(const float* s, int64_t ss, const T* v_cache, const int64_t* slot, int64_t n,
                                   int64_t hk, int64_t hkv, int64_t d, int64_t c0, float* out) {
  __m256 acc[GB][2 * CN];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 2 * CN; ++i) acc[g][i] = _mm256_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    const T* vr = v_cache + (slot[l] * hkv + hk) * d + 16 * c0;
    if (l + kAheadRows < n) prefetch_rows(v_cache + 16 * c0, slot, l + kAheadRows, l + kAheadRows + 1, hk, hkv, d);
    for (int c = 0; c < CN; ++c) {
      __m256 v0, v1;
      chunk16(vr + 16 * c, v0, v1);
      for (int g = 0; g < GB; ++g) {
        const __m256 p = _mm256_broadcast_ss(s + g * ss + l);
        acc[g][2 * c] = _mm256_fmadd_ps(p, v0, acc[g][2 * c]);
        acc[g][2 * c + 1] = _mm256_fmadd_ps(p, v1, acc[g][2 * c + 1]);
      }
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 2 * CN; ++i) _mm256_storeu_ps(out + g * d + 16 * c0 + 8 * i, acc[g][i]);
}

template <typename T, int GB>
KILN_ATTN_AVX2 void pv_avx2(const float* s, int64_t ss, const T* v_cache, const int64_t* slot, int64_t n,
                            int64_t hk, int64_t hkv, int64_t d, float* out) {
  const int64_t nc = d / 16;
  int64_t c0 = 0;
  for (; c0 + 2 <= nc; c0 += 2) pv_chunks_avx2<T, GB, 2>(s, ss, v_cache, slot, n, hk, hkv, d, c0, out);
  if (c0 < nc) pv_chunks_avx2<T, GB, 1>(s, ss, v_cache, slot, n, hk, hkv, d, c0, out);
}

// One split for the query heads of KV head hk (d a multiple of 16, at most 256).
template <typename T>
KILN_ATTN_AVX2 void split_avx2(const T* qh, float sc, const T* k_cache, const T* v_cache, const int64_t* slot,
                               int64_t n, int64_t hk, int64_t hkv, int64_t d, int64_t groups, float* rec) {
  thread_local std::vector<float> qbuf, sbuf, obuf;
  qbuf.resize(static_cast<size_t>(groups * d));
  sbuf.resize(static_cast<size_t>(groups * (kSplitMax + 8)));
  obuf.resize(static_cast<size_t>(groups * d));
  float* q = qbuf.data();
  // the query in chunk16's order, as the K rows come
  const __m256 scv = _mm256_set1_ps(sc);
  for (int64_t i = 0; i < groups * d; i += 16) {
    __m256 a, b;
    chunk16(qh + i, a, b);
    _mm256_storeu_ps(q + i, _mm256_mul_ps(a, scv));
    _mm256_storeu_ps(q + i + 8, _mm256_mul_ps(b, scv));
  }
  const int64_t ss = kSplitMax + 8;
  // the pass below asks for rows kAheadRows ahead of itself: ask for its first ones now
  prefetch_rows(k_cache, slot, 0, std::min<int64_t>(n, kAheadRows), hk, hkv, d);
  // scores, 8 positions at a time (rows past n repeat the last one; their lanes are masked), for up
  // to 3 heads per pass over the block's K rows
  for (int64_t b = 0; b < n; b += 8) {
    const T* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = k_cache + (slot[b + std::min<int64_t>(j, n - 1 - b)] * hkv + hk) * d;
    prefetch_rows(k_cache, slot, b + kAheadRows, std::min<int64_t>(n, b + kAheadRows + 8), hk, hkv, d);
    const __m256 valid = lanes_below8(n - b);
    for (int64_t g0 = 0; g0 < groups; g0 += 3) {
      float* sg = sbuf.data() + g0 * ss;
      switch (std::min<int64_t>(3, groups - g0)) {
        case 1: qk_block_avx2<T, 1>(q + g0 * d, d, rows, valid, sg, ss, b); break;
        case 2: qk_block_avx2<T, 2>(q + g0 * d, d, rows, valid, sg, ss, b); break;
        default: qk_block_avx2<T, 3>(q + g0 * d, d, rows, valid, sg, ss, b); break;
      }
    }
  }
  // softmax numerators in place (0 past n), each head's max and sum into the record, while the V
  // pass's first rows are on their way
  prefetch_rows(v_cache, slot, 0, std::min<int64_t>(n, kAheadRows), hk, hkv, d);
  for (int64_t g = 0; g < groups; ++g) {
    float* sg = sbuf.data() + g * ss;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t b = 0; b < n; b += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + b));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float m = lanes[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t b = 0; b < n; b += 8) {
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + b), _mm256_set1_ps(m))), lanes_below8(n - b));
      _mm256_storeu_ps(sg + b, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_store_ps(lanes, sum);
    float l = 0.f;
    for (float v : lanes) l += v;
    rec[g] = m;
    rec[groups + g] = l;
  }
  // outputs, up to 3 heads per pass over V, then back into natural order in the record
  float* o = obuf.data();
  for (int64_t g0 = 0; g0 < groups; g0 += 3) {
    const float* sg = sbuf.data() + g0 * ss;
    switch (std::min<int64_t>(3, groups - g0)) {
      case 1: pv_avx2<T, 1>(sg, ss, v_cache, slot, n, hk, hkv, d, o + g0 * d); break;
      case 2: pv_avx2<T, 2>(sg, ss, v_cache, slot, n, hk, hkv, d, o + g0 * d); break;
      default: pv_avx2<T, 3>(sg, ss, v_cache, slot, n, hk, hkv, d, o + g0 * d); break;
    }
  }
  float* out = rec + 2 * groups;
  for (int64_t i = 0; i < groups * d; i += 16) {
    const __m256 a = _mm256_loadu_ps(o + i), b = _mm256_loadu_ps(o + i + 8);
    if (std::is_same<T, float>::value) {
      _mm256_storeu_ps(out + i, a);
      _mm256_storeu_ps(out + i + 8, b);
    } else {   // (even, odd) pieces interleave back into 16 values in order
      const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
      _mm256_storeu_ps(out + i, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(out + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  }
}

// combine_splits on AVX2 with its very operations (a product, then a sum; the scalar cast's rounding),
// so the same bits: for records in natural order, d a multiple of 16.
KILN_ATTN_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KILN_ATTN_AVX2 inline void store8(c10::BFloat16* p, __m256 v) { kiln::store_bf16_bits8(p, kiln::bf16_bits8(v)); }

template <typename T>
KILN_ATTN_AVX2 void combine_avx2(const float* recs, int64_t splits, int64_t groups, int64_t d, T* out) {
  const int64_t size = record_size(groups, d);
  for (int64_t g = 0; g < groups; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, recs[s * size + g]);
    float sum = 0.f;
    float w[kMaxSplitsAvx2];
    for (int64_t s = 0; s < splits; ++s) {
      const float* r = recs + s * size;
      w[s] = std::exp(r[g] - mx);
      sum += w[s] * r[groups + g];
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int64_t i = 0; i < d; i += 8) {
      __m256 o = _mm256_setzero_ps();
      for (int64_t s = 0; s < splits; ++s)
        o = _mm256_add_ps(o, _mm256_mul_ps(_mm256_set1_ps(w[s]), _mm256_loadu_ps(recs + s * size + 2 * groups + g * d + i)));
      store8(out + g * d + i, _mm256_mul_ps(o, inv));
    }
  }
}
#endif

// Query token t attends to positions 0..lens[t]-1 of slot row t: out[t, h] for every head h.
// Tasks are (token, split, KV heads) on the kernels' pool; a KV head's query heads share each pass
// over its K and V rows. A token with several splits is combined by whichever of its tasks ends last
// (the combination itself is in split order). How tasks group heads never changes a bit.
template <typename T>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& slots, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t tokens = q.size(0), lmax = slots.size(1);
  const int64_t hkv = k_cache.size(1), d = k_cache.size(2), heads = q.size(1), groups = heads / hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t slot_stride = slots.stride(0);   // 0: a prompt chunk's tokens share one slot row
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  const float sc = static_cast<float>(scale);
#ifdef KILN_ATTN_X86
  const int64_t isa = kiln::active_isa();
  const bool vec = attn_avx512(isa) && d % 16 == 0 && d <= 16 * kMaxNV;
  const bool bf16_dot = vec && d % 32 == 0 && attn_bf16_dot(isa);
  const bool avx2 = !vec && isa >= kiln::ISA_AVX2 && d % 16 == 0 && d <= 256;
#endif
  // the buffers below are the calling thread's: the tasks, on other threads too, use them through
  // pointers. task_end[t]: tasks of tokens 0..t; first_rec[t]: where token t's split records start.
  thread_local std::vector<int64_t> task_end_buf, first_rec_buf;
  thread_local std::vector<float> rec_buf;
  task_end_buf.resize(static_cast<size_t>(tokens));
  first_rec_buf.resize(static_cast<size_t>(tokens));
  int64_t units = 0;   // (token, split) pairs
  for (int64_t t = 0; t < tokens; ++t) units += split_count(std::max<int64_t>(0, std::min(lp[t], lmax)));
  // KV heads per task: all of a position's rows at once when there are splits enough to go round
  const int64_t per_task = units >= 2 * at::get_num_threads() ? hkv : 1, chunks = hkv / per_task;
  const int64_t size = record_size(groups, d);
  int64_t tasks = 0, records = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t splits = split_count(std::max<int64_t>(0, std::min(lp[t], lmax)));
    tasks += chunks * splits;
    task_end_buf[t] = tasks;
    first_rec_buf[t] = records;
    if (splits > 1) records += hkv * splits;
  }
  if (rec_buf.size() < static_cast<size_t>(records * size)) rec_buf.resize(static_cast<size_t>(records * size));
  const int64_t* task_end = task_end_buf.data();
  const int64_t* first_rec = first_rec_buf.data();
  float* recs = rec_buf.data();
  const auto finish = [&](const float* first, int64_t splits, T* oh) {
#ifdef KILN_ATTN_X86
    if (vec) return combine_avx512<T>(first, splits, groups, d, oh);
    if (avx2 && splits <= kMaxSplitsAvx2) return combine_avx2<T>(first, splits, groups, d, oh);
#endif
    combine_splits<T>(first, splits, groups, d, oh);
  };
  std::vector<std::atomic<int32_t>> done(records > 0 ? static_cast<size_t>(tokens) : 0);
  kiln::parallel_tasks(tasks, [&](int64_t task) {
    const int64_t t = std::upper_bound(task_end, task_end + tokens, task) - task_end;
    const int64_t len = std::max<int64_t>(0, std::min(lp[t], lmax));
    const int64_t splits = split_count(len);
    const int64_t local = task - (t > 0 ? task_end[t - 1] : 0), sidx = local / chunks;
    const int64_t hk0 = (local % chunks) * per_task;
    if (len == 0) {
      T* oh = op + (t * heads + hk0 * groups) * d;
      std::fill(oh, oh + per_task * groups * d, static_cast<T>(0.f));
      return;
    }
    const int64_t l0 = split_begin(len, splits, sidx), n = split_begin(len, splits, sidx + 1) - l0;
    const int64_t* slot = sp + t * slot_stride + l0;
    thread_local std::vector<float> own;
    if (splits == 1) own.resize(static_cast<size_t>(size));
    for (int64_t hk = hk0; hk < hk0 + per_task; ++hk) {
      float* rec = splits > 1 ? recs + (first_rec[t] + hk * splits + sidx) * size : own.data();
      const T* qh = qp + t * q_stride + hk * groups * d;
#ifdef KILN_ATTN_X86
      if (vec) {
        split_vector<T>(qh, sc, kp, vp, slot, n, hk, hkv, d, groups, bf16_dot, rec);
      } else if (avx2) {
        split_avx2<T>(qh, sc, kp, vp, slot, n, hk, hkv, d, groups, rec);
      } else
#endif
      {
        split_scalar<T>(qh, sc, kp, vp, slot, n, hk, hkv, d, groups, rec);
      }
      if (splits == 1) finish(rec, 1, op + (t * heads + hk * groups) * d);
    }
    // the last of the token's tasks acquires the others' records (each released by its fetch_add)
    if (splits > 1 && done[t].fetch_add(1, std::memory_order_acq_rel) + 1 == splits * chunks) {
      for (int64_t hk = 0; hk < hkv; ++hk)
        finish(recs + (first_rec[t] + hk * splits) * size, splits, op + (t * heads + hk * groups) * d);
    }
  });
}

// Rotary embedding in place on rows [T, H, D] (cos/sin_signed [T, D] per token, rotate-half form:
// x*cos + roll(x, D/2)*sin_signed), rounded like torch's mul-then-addcmul.
template <typename T>
void rope_rows(T* x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t d, const T* cos, const T* sin,
               int64_t cs_stride, std::vector<float>& buf) {
  const int64_t half = d / 2;
  buf.resize(static_cast<size_t>(d));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * cs_stride;
    const T* sn = sin + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      T* row = x + t * x_stride + h * d;
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
void write_rows(const T* src, int64_t src_stride, T* cache, const int64_t* slots, int64_t tokens, int64_t row) {
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(cache + slots[t] * row, src + t * src_stride, sizeof(T) * row);
}

// rope_and_cache for one dtype, on the checked tensors
template <typename T>
void rope_and_cache_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const int64_t* slots) {
  const int64_t tokens = q.size(0), d = q.size(2), row = k.size(1) * d;
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  // tokens are independent: a few per task on the kernels' pool (each value computed as before)
  const int64_t per = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, (q.size(1) + k.size(1)) * d));
  kiln::parallel_tasks((tokens + per - 1) / per, [&](int64_t c) {
    const int64_t t0 = c * per, n = std::min(per, tokens - t0);
    thread_local std::vector<float> buf;   // one head row widened; kept across calls (a decode hot path)
    rope_rows<T>(qp + t0 * q.stride(0), q.stride(0), n, q.size(1), d, cp + t0 * d, sp + t0 * d, d, buf);
    rope_rows<T>(kp + t0 * k.stride(0), k.stride(0), n, k.size(1), d, cp + t0 * d, sp + t0 * d, d, buf);
    write_rows<T>(kp + t0 * k.stride(0), k.stride(0), k_cache.data_ptr<T>(), slots + t0, n, row);
    write_rows<T>(vp + t0 * v.stride(0), v.stride(0), v_cache.data_ptr<T>(), slots + t0, n, row);
  });
}

// h += delta, rounded to T as at::add rounds it (one float sum per element).
template <typename T>
void add_rows(T* h, const T* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<T>(to_float(h[i]) + to_float(delta[i]));
}

// ---- greedy pick ----
// A greedy row's token and its log-softmax: the first index of the row's maximum, and
// -log(sum exp(x - max)) (the chosen logit is the max). Two passes over the row, nothing written:
// torch's log_softmax + argmax + gather wrote and re-read a float32 copy of every row. A row is one
// task: its sums never depend on the batch or the thread count. NaN rows take the scalar path (the
// first NaN is torch.argmax's pick, and the log-prob is NaN, as log_softmax gives it).
constexpr int kPickLanes = 16;

// The sum of exp(x - mx) over a row, in kPickLanes partial sums combined pairwise.
inline float combine_lanes(float* lanes) {
  for (int w = kPickLanes / 2; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  return lanes[0];
}

void pick_scalar(const float* x, int64_t v, int64_t* token, float* logprob) {
  int64_t best = 0;
  for (int64_t i = 1; i < v; ++i)
    if (x[i] > x[best] || (std::isnan(x[i]) && !std::isnan(x[best]))) best = i;
  const float mx = x[best];
  *token = best;
  if (std::isnan(mx) || mx == -INFINITY) {   // log_softmax of such a row is NaN throughout
    *logprob = NAN;
    return;
  }
  float lanes[kPickLanes] = {};
  for (int64_t i = 0; i < v; ++i) lanes[i % kPickLanes] += std::exp(x[i] - mx);
  *logprob = -std::log(combine_lanes(lanes));
}

// The first index of mx in the row (the vector passes find the value, this the place).
inline int64_t first_index(const float* x, int64_t v, float mx) {
  for (int64_t i = 0; i < v; ++i)
    if (x[i] == mx) return i;
  return 0;
}

#ifdef KILN_ATTN_X86
KILN_ATTN_AVX512 void pick_avx512(const float* x, int64_t v, int64_t* token, float* logprob) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    const __m512 a = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, a);
  }
  float mx = _mm512_reduce_max_ps(m);
  bool has_nan = nan != 0;
  for (int64_t j = i; j < v; ++j) {
    has_nan |= std::isnan(x[j]);
    mx = std::max(mx, x[j]);
  }
  if (has_nan || mx == -INFINITY) return pick_scalar(x, v, token, logprob);
  *token = first_index(x, v, mx);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= v; i += 16) sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  if (i < v) {
    const __mmask16 k = lanes_below(v - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  alignas(64) float lanes[kPickLanes];
  _mm512_store_ps(lanes, sum);
  *logprob = -std::log(combine_lanes(lanes));
}
KILN_ATTN_AVX2 void pick_avx2(const float* x, int64_t v, int64_t* token, float* logprob) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= v; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  alignas(32) float lanes[kPickLanes];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float mx = lanes[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, lanes[j]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < v; ++j) {
    has_nan |= std::isnan(x[j]);
    mx = std::max(mx, x[j]);
  }
  if (has_nan || mx == -INFINITY) return pick_scalar(x, v, token, logprob);
  *token = first_index(x, v, mx);
  // two ymm sums are pick_avx512's 16 lanes: the same additions in the same order
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (i = 0; i + 16 <= v; i += 16) {
    s0 = _mm256_add_ps(s0, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    s1 = _mm256_add_ps(s1, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
  }
  _mm256_store_ps(lanes, s0);
  _mm256_store_ps(lanes + 8, s1);
  for (int64_t j = i; j < v; ++j) {   // the tail, lane by lane (exp8 on one value at a time)
    alignas(32) float e[8];
    _mm256_store_ps(e, exp8(_mm256_set1_ps(x[j] - mx)));
    lanes[j - i] += e[0];
  }
  *logprob = -std::log(combine_lanes(lanes));
}
#endif

}  // namespace

namespace kiln {

void rope_and_cache(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const torch::Tensor& cos,
                    const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
                    const torch::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 3 &&
                        v_cache.sizes() == k_cache.sizes() && k.size(1) == k_cache.size(1) &&
                        k.size(2) == k_cache.size(2) && q.size(2) == k.size(2) && q.size(0) == k.size(0),
                    "kiln rope_and_cache: q [T, H, D], k and v [T, Hkv, D], caches [N, Hkv, D]");
  // q, k and v may be row views of one fused projection output: each token's [H, D] must be dense
  const auto dense_rows = [](const torch::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  TORCH_CHECK_VALUE(dense_rows(q) && dense_rows(k) && dense_rows(v) && k_cache.is_contiguous() &&
                        v_cache.is_contiguous() && slot_mapping.is_contiguous(),
                    "kiln rope_and_cache: contiguous caches and [H, D] rows of q, k and v");
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
  if (dt == torch::kFloat32) {
    rope_and_cache_rows<float>(q, k, v, cos, sin, k_cache, v_cache, slots);
  } else if (dt == torch::kBFloat16) {
    rope_and_cache_rows<c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, slots);
  } else {
    TORCH_CHECK_VALUE(false, "kiln rope_and_cache: float32 or bfloat16 only");
  }
}


#ifdef KILN_ATTN_X86
// rms_norm_rows on AVX2 with the same operations (and so the same bits) as the scalar code above.
KILN_ATTN_AVX2 inline __m256 norm_load8(const float* p) { return _mm256_loadu_ps(p); }
KILN_ATTN_AVX2 inline __m256 norm_load8(const c10::BFloat16* p) { return kiln::bf16x8_to_float(p); }
KILN_ATTN_AVX2 inline void norm_store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KILN_ATTN_AVX2 inline void norm_store8(c10::BFloat16* p, __m256 v) {   // v already rounded to bfloat16
  kiln::store_bf16_bits8(p, _mm256_srli_epi32(_mm256_castps_si256(v), 16));
}

template <typename T>
KILN_ATTN_AVX2 inline __m256 norm_round(__m256 v) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) return kiln::round_to_bf16x8(v);
  return v;
}

template <typename T>
KILN_ATTN_AVX2 void rms_norm_rows_avx2(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride,
                                       float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256 v0 = norm_load8(xr + i), v1 = norm_load8(xr + i + 8);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
    }
    if (i < n) {   // the tail through the same lanes, zeros past n (adding +0 changes no sum)
      alignas(32) float t[16] = {};
      for (int64_t j = i; j < n; ++j) t[j - i] = to_float(xr[j]);
      const __m256 v0 = _mm256_load_ps(t), v1 = _mm256_load_ps(t + 8);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(v0, v0));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(v1, v1));
    }
    const __m256 s8 = _mm256_add_ps(a0, a1);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));   // (s4[0] + s4[2], s4[1] + s4[3])
    const float ss = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= n; i += 8)
      norm_store8(yr + i, norm_round<T>(_mm256_mul_ps(norm_round<T>(_mm256_mul_ps(norm_load8(xr + i), iv)), norm_load8(w + i))));
    for (; i < n; ++i) {
      const T normed = static_cast<T>(to_float(xr[i]) * inv);
      yr[i] = static_cast<T>(to_float(normed) * to_float(w[i]));
    }
  }
}
#endif

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0) && x.stride(1) == 1 && w.is_contiguous(),
                    "kiln rms_norm: x [T, n] with contiguous rows, w [n]");
  TORCH_CHECK_VALUE(x.scalar_type() == w.scalar_type(), "kiln rms_norm: x and w must share a dtype");
  TORCH_CHECK_VALUE(x.device().is_cpu() && w.device().is_cpu(), "kiln rms_norm: CPU tensors only");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  const float e = static_cast<float>(eps);
  TORCH_CHECK_VALUE(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
                    "kiln rms_norm: float32 or bfloat16 only");
  const int64_t per = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, n)), xs = x.stride(0);
#ifdef KILN_ATTN_X86
  const int64_t isa = kiln::active_isa();
#endif
  kiln::parallel_tasks((rows + per - 1) / per, [&](int64_t c) {
    const int64_t r0 = c * per, m = std::min(per, rows - r0);
    auto rows_of = [&](auto* xp, auto* wp, auto* yp) {
      using T = std::remove_pointer_t<decltype(yp)>;
#ifdef KILN_ATTN_X86
      if (isa >= kiln::ISA_AVX2) return rms_norm_rows_avx2<T>(xp + r0 * xs, wp, yp + r0 * n, m, n, xs, e);
#endif
      rms_norm_rows<T>(xp + r0 * xs, wp, yp + r0 * n, m, n, xs, e);
    };
    if (x.scalar_type() == torch::kFloat32) {
      rows_of(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
    } else {
      rows_of(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
    }
  });
  return y;
}

void add_inplace(torch::Tensor h, const torch::Tensor& delta) {
  TORCH_CHECK_VALUE(h.is_contiguous() && delta.is_contiguous() && h.sizes() == delta.sizes() &&
                        h.scalar_type() == delta.scalar_type(),
                    "kiln add_inplace: h and delta must be contiguous tensors of one shape and dtype");
  TORCH_CHECK_VALUE(h.scalar_type() == torch::kFloat32 || h.scalar_type() == torch::kBFloat16,
                    "kiln add_inplace: float32 or bfloat16 only");
  const int64_t total = h.numel(), per = 4 * kElementwiseGrain;
  kiln::parallel_tasks((total + per - 1) / per, [&](int64_t c) {
    const int64_t i0 = c * per, m = std::min(per, total - i0);
    if (h.scalar_type() == torch::kFloat32) {
      add_rows<float>(h.data_ptr<float>() + i0, delta.data_ptr<float>() + i0, m);
    } else {
      add_rows<c10::BFloat16>(h.data_ptr<c10::BFloat16>() + i0, delta.data_ptr<c10::BFloat16>() + i0, m);
    }
  });
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
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && lens.is_contiguous() &&
                        (slots.size(1) <= 1 || slots.stride(1) == 1) && slots.stride(0) >= 0 &&
                        q.stride(2) == 1 && q.stride(1) == q.size(2),
                    "kiln paged_attention: contiguous caches, slot rows and per-token query rows");
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

std::tuple<torch::Tensor, torch::Tensor> greedy_pick(const torch::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu() &&
                        logits.stride(1) == 1 && logits.size(1) > 0,
                    "kiln greedy_pick: logits must be a [B, V] float32 CPU tensor with contiguous rows, V > 0");
  const int64_t rows = logits.size(0), v = logits.size(1), stride = logits.stride(0);
  auto tokens = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  auto logprobs = torch::empty({rows}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
#ifdef KILN_ATTN_X86
  const int64_t isa = kiln::active_isa();
#endif
  kiln::parallel_tasks(rows, [&](int64_t r) {
    const float* row = x + r * stride;
#ifdef KILN_ATTN_X86
    if (attn_avx512(isa)) return pick_avx512(row, v, tp + r, lp + r);
    if (isa >= kiln::ISA_AVX2) return pick_avx2(row, v, tp + r, lp + r);
#endif
    pick_scalar(row, v, tp + r, lp + r);
  });
  return {tokens, logprobs};
}

}  // namespace kiln
