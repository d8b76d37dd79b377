// The K-quant tiles back into dense weights, for the torch paths: training and scoring over a model held
// only as blocks dequantize every projection where they use it, in forward and in backward, so this runs
// over the whole model twice a training step.
//
// Each value is computed in float32 as gguf.quants.dequantize computes it (Q4_K / Q5_K:
// q * (d * sc) - dmin * m, two roundings; Q6_K: (q - 32) * (d * sc)), then rounded to bfloat16 if asked.
// The scalar path is the reference; the AVX2 and AVX-512 paths run the same float32 operations in the
// same order (a product, then a sum with the exactly negated dmin * m; never a fused multiply-add), so
// every ISA gives the same bits. The SIMD paths turn a group's 16 (AVX-512) or 8 (AVX2) rows of codes,
// which the tile stores as 4-byte runs of each row side by side, into each row's 32 codes in K order
// with a 4x4 transpose of 32-bit words in registers, then widen, scale and store one row at a time.

#include "kquant_pack.h"

#include "bf16_simd.h"
#include "isa.h"
#include "kquant_tiles.h"
#include "qlinear.h"

#include <cstdint>
#include <cstring>

namespace {

using namespace kiln::kq;
using kiln::float_to_bf16_bits;
using kiln::half_bits_to_float;

struct Dense {
  const uint8_t* qs;   // [T, S, super_bytes]
  const uint8_t* sc;   // [T, S, scale_bytes]
  int64_t S, n, k;
  bool bf16;
  void* out;           // [n, k]
};

// ---------------------------------------------------------------- scalar reference

template <int F>
void tile_scalar(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S;
  for (int r = 0; r < kRows && t * kRows + r < p.n; ++r) {
    const int64_t row = t * kRows + r;
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* sb = p.sc + (t * S + s) * SB;
      const float d = half_bits_to_float(load_u16(sb + 2 * r));
      const float dmin = F == Q6K ? 0.0f : half_bits_to_float(load_u16(sb + 32 + 2 * r));
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
        float a0, a1, b = 0.0f;
        if (F == Q6K) {
          a0 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j) * 16 + r]));
          a1 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j + 1) * 16 + r]));
        } else {
          int sc, mn;
          scale_min_scalar(sb, r, j, sc, mn);
          a0 = a1 = d * static_cast<float>(sc);
          b = dmin * static_cast<float>(mn);
        }
        float w[kGroup];
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = qg[c * 64 + r * 4 + i];
            int lo = byte & 15, hi = byte >> 4;
            if (F == Q5K) {
              const int hb = qg[256 + r * 4 + i];
              lo |= ((hb >> c) & 1) << 4;
              hi |= ((hb >> (4 + c)) & 1) << 4;
            }
            if (F == Q6K) {
              lo |= ((qg[256 + r * 4 + i] >> (2 * c)) & 3) << 4;
              hi |= ((qg[320 + r * 4 + i] >> (2 * c)) & 3) << 4;
              w[4 * c + i] = static_cast<float>(lo - 32) * a0;
              w[16 + 4 * c + i] = static_cast<float>(hi - 32) * a1;
            } else {
              w[4 * c + i] = static_cast<float>(lo) * a0 - b;
              w[16 + 4 * c + i] = static_cast<float>(hi) * a1 - b;
            }
          }
        const int64_t at = row * p.k + s * kSuper + j * kGroup;
        if (p.bf16) {
          uint16_t* o = static_cast<uint16_t*>(p.out) + at;
          for (int i = 0; i < kGroup; ++i) o[i] = float_to_bf16_bits(w[i]);
        } else {
          std::memcpy(static_cast<float*>(p.out) + at, w, sizeof(w));
        }
      }
    }
  }
}

#ifdef KILN_KQ_X86

// ---------------------------------------------------------------- AVX-512: a group's 16 rows at once

// 4x4 transpose of 32-bit words within each 128-bit lane: in, word p of lane L of vector c is row 4L+p's
// 4 codes of run c; out, lane L of vector p holds row 4L+p's runs 0..3, its 16 codes in K order.
KILN_KQ_AVX512 inline void transpose_runs(const __m512i* a, uint8_t* buf) {
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpacklo_epi32(a[2], a[3]);
  const __m512i t2 = _mm512_unpackhi_epi32(a[0], a[1]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  _mm512_store_si512(buf, _mm512_unpacklo_epi64(t0, t1));
  _mm512_store_si512(buf + 64, _mm512_unpackhi_epi64(t0, t1));
  _mm512_store_si512(buf + 128, _mm512_unpacklo_epi64(t2, t3));
  _mm512_store_si512(buf + 192, _mm512_unpackhi_epi64(t2, t3));
}

// 16 codes (bytes; Q6_K signed) times a, plus b, stored as float32 or bfloat16
template <int F>
KILN_KQ_AVX512 inline void row16_avx512(const uint8_t* codes, float a, float b, bool bf16, void* dst) {
  const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(codes));
  const __m512 v = _mm512_cvtepi32_ps(F == Q6K ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q));
  __m512 w = _mm512_mul_ps(v, _mm512_set1_ps(a));
  if (F != Q6K) w = _mm512_add_ps(w, _mm512_set1_ps(b));
  if (bf16) {
    _mm256_storeu_si256(static_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(kiln::bf16_bits16(w)));
  } else {
    _mm512_storeu_ps(static_cast<float*>(dst), w);
  }
}

template <int F>
KILN_KQ_AVX512 void tile_avx512(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S, rows = p.n - t * kRows < kRows ? p.n - t * kRows : kRows, es = p.bf16 ? 2 : 4;
  alignas(64) float f0[8][kRows], f1[8][kRows];
  alignas(64) uint8_t lo[256], hi[256];
  uint8_t* out = static_cast<uint8_t*>(p.out) + t * kRows * p.k * es;
  for (int64_t s = 0; s < S; ++s) {
    __m512 v0[8], v1[8];
    scales_avx512<F>(p.sc + (t * S + s) * SB, v0, v1);
    for (int j = 0; j < 8; ++j) {
      _mm512_store_ps(f0[j], v0[j]);
      _mm512_store_ps(f1[j], v1[j]);
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
      __m512i a[4], b[4];
      if (F == Q4K) {
        const __m512i m15 = _mm512_set1_epi8(15);
        for (int c = 0; c < 4; ++c) a[c] = _mm512_loadu_si512(qg + c * 64);
        alignas(64) uint8_t raw[256];
        transpose_runs(a, raw);
        for (int x = 0; x < 4; ++x) {
          const __m512i v = _mm512_load_si512(raw + 64 * x);
          _mm512_store_si512(lo + 64 * x, _mm512_and_si512(v, m15));
          _mm512_store_si512(hi + 64 * x, _mm512_and_si512(_mm512_srli_epi16(v, 4), m15));
        }
      } else {
        for (int c = 0; c < 4; ++c) codes_avx512<F>(qg, c, a[c], b[c]);
        transpose_runs(a, lo);
        transpose_runs(b, hi);
      }
      const int64_t col = s * kSuper + j * kGroup;
      for (int r = 0; r < rows; ++r) {
        const int at = (r & 3) * 64 + (r >> 2) * 16;
        uint8_t* o = out + (r * p.k + col) * es;
        if (F == Q6K) {
          row16_avx512<F>(lo + at, f0[j][r], 0.0f, p.bf16, o);
          row16_avx512<F>(hi + at, f1[j][r], 0.0f, p.bf16, o + 16 * es);
        } else {
          row16_avx512<F>(lo + at, f0[j][r], f1[j][r], p.bf16, o);
          row16_avx512<F>(hi + at, f0[j][r], f1[j][r], p.bf16, o + 16 * es);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- AVX2: a group's rows 8 at a time

KILN_KQ_AVX2 inline void transpose_runs(const __m256i* a, uint8_t* buf) {
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpacklo_epi32(a[2], a[3]);
  const __m256i t2 = _mm256_unpackhi_epi32(a[0], a[1]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), _mm256_unpacklo_epi64(t0, t1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 32), _mm256_unpackhi_epi64(t0, t1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 64), _mm256_unpacklo_epi64(t2, t3));
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf + 96), _mm256_unpackhi_epi64(t2, t3));
}

template <int F>
KILN_KQ_AVX2 inline void row8_avx2(const uint8_t* codes, float a, float b, bool bf16, void* dst) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m256 v = _mm256_cvtepi32_ps(F == Q6K ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
  __m256 w = _mm256_mul_ps(v, _mm256_set1_ps(a));
  if (F != Q6K) w = _mm256_add_ps(w, _mm256_set1_ps(b));
  if (bf16) {
    kiln::store_bf16_bits8(dst, kiln::bf16_bits8(w));
  } else {
    _mm256_storeu_ps(static_cast<float*>(dst), w);
  }
}

template <int F>
KILN_KQ_AVX2 void tile_avx2(const Dense& p, int64_t t) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t S = p.S, rows = p.n - t * kRows < kRows ? p.n - t * kRows : kRows, es = p.bf16 ? 2 : 4;
  alignas(32) float f0[8][kRows], f1[8][kRows];
  alignas(32) uint8_t lo[128], hi[128];
  uint8_t* out = static_cast<uint8_t*>(p.out) + t * kRows * p.k * es;
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* sb = p.sc + (t * S + s) * SB;
    for (int h = 0; h < 2; ++h) {
      __m256 v0[8], v1[8];
      scales_avx2<F>(sb, h, v0, v1);
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_ps(f0[j] + 8 * h, v0[j]);
        _mm256_storeu_ps(f1[j] + 8 * h, v1[j]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qg = p.qs + (t * S + s) * QS + j * QB;
      const int64_t col = s * kSuper + j * kGroup;
      for (int h = 0; h < 2 && 8 * h < rows; ++h) {
        __m256i a[4], b[4];
        for (int c = 0; c < 4; ++c) codes_avx2<F>(qg, c, h, a[c], b[c]);
        transpose_runs(a, lo);
        transpose_runs(b, hi);
        for (int r = 8 * h; r < rows && r < 8 * h + 8; ++r) {
          const int at = (r & 3) * 32 + ((r >> 2) & 1) * 16;
          const float ca = f0[j][r], cb = F == Q6K ? f1[j][r] : f0[j][r], m = F == Q6K ? 0.0f : f1[j][r];
          uint8_t* o = out + (r * p.k + col) * es;
          row8_avx2<F>(lo + at, ca, m, p.bf16, o);
          row8_avx2<F>(lo + at + 8, ca, m, p.bf16, o + 8 * es);
          row8_avx2<F>(hi + at, cb, m, p.bf16, o + 16 * es);
          row8_avx2<F>(hi + at + 8, cb, m, p.bf16, o + 24 * es);
        }
      }
    }
  }
}
#endif

template <int F>
void dequantize_all(const Dense& p, int64_t isa) {
  const int64_t T = (p.n + kRows - 1) / kRows;
#ifdef KILN_KQ_X86
  if (isa >= kiln::ISA_AVX512) return kiln::parallel_tasks(T, [&](int64_t t) { tile_avx512<F>(p, t); });
  if (isa >= kiln::ISA_AVX2) return kiln::parallel_tasks(T, [&](int64_t t) { tile_avx2<F>(p, t); });
#endif
  kiln::parallel_tasks(T, [&](int64_t t) { tile_scalar<F>(p, t); });
}

}  // namespace

namespace kiln {

torch::Tensor kquant_dequantize(const torch::Tensor& qs, const torch::Tensor& scales, int64_t fmt, int64_t n,
                                int64_t k, bool bf16, int64_t isa, const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK_VALUE(fmt >= Q4K && fmt <= Q6K, "kquant_dequantize: unknown format ", fmt);
  const int f = static_cast<int>(fmt);
  const int64_t S = k / kSuper, T = (n + kRows - 1) / kRows;
  TORCH_CHECK_VALUE(k % kSuper == 0 && qs.is_contiguous() && scales.is_contiguous() &&
                        qs.numel() >= T * S * super_bytes(f) && scales.numel() >= T * S * scale_bytes(f),
                    "kquant_dequantize: the tiles do not match n = ", n, ", k = ", k);
  const int64_t level = resolve_isa(isa, "kiln kquant_dequantize");
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor y;
  if (out.has_value() && out->defined()) {
    y = *out;
    TORCH_CHECK_VALUE(y.device().is_cpu() && y.scalar_type() == dtype && y.is_contiguous() && y.numel() == n * k,
                      "kquant_dequantize: out must be a contiguous CPU ", bf16 ? "bfloat16" : "float32",
                      " tensor of ", n * k, " values");
  } else {
    y = torch::empty({n, k}, qs.options().dtype(dtype));
  }
  if (n == 0 || k == 0) return y;
  const Dense p{qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), S, n, k, bf16, y.data_ptr()};
  if (f == Q4K) dequantize_all<Q4K>(p, level);
  else if (f == Q5K) dequantize_all<Q5K>(p, level);
  else dequantize_all<Q6K>(p, level);
  return y;
}

}  // namespace kiln
