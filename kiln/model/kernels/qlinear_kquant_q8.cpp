// K-quant weights (GGUF Q4_K, Q5_K, Q6_K) with 8-bit activations, as llama.cpp multiplies them, on the
// same tiles qlinear_kquant.cpp reads (kquant_tiles.h). The activations are quantized per group of 32 as
// qlinear.cpp quantizes them for q4_1 (int8, scale xd = amax / 127, xs = xd * the group's int8 sum; llama.cpp's
// Q8_K rounds per 256 with one scale, so its logits are near these, not equal), so
// each group of each output row is one integer dot product of the stored codes with the int8
// activations (AVX512-VNNI vpdpbusd; AVX2 maddubs + madd; exact in int32 everywhere), then float32:
//   Q4_K / Q5_K, codes q (0..15 / 0..31), group g with scale sc and min m:
//     a = fma(float(sum q * xq), (d * sc) * xd, acc); acc = fma(-(dmin * m), xs, a)
//   Q6_K, stored codes u = q + 32 (0..63), the group's halves (K 0..15 and 16..31) scaled sc0 and sc1:
//     acc = fma(float(sum u * xq - 32 * sum xq), (d * sc0) * xd, acc), then the same for the high half
// A tile's 16 rows are the 16 int32 lanes (4 consecutive K values a lane, as the tiles store them), so
// one vpdpbusd with 4 activation bytes broadcast advances 16 rows. A decode step reads 4.5-6.6 bits a
// weight at the memory's rate instead of converting every code to float (the float path is
// compute-bound on two cores: ~13 GB/s a core on Zen 4 against the ~30 GB/s DRAM gives).
//
// Every output is one fixed sequence of operations (exact integer sums, then the float32 operations above
// in group order), whatever M, the row block, the thread or the ISA, so the scalar, AVX2 and AVX-512
// paths give the same bits and a row's result never depends on its batch.

#include "qlinear_kquant.h"

#include "isa.h"
#include "kquant_tiles.h"
#include "qlinear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kiln::half_bits_to_float;
using namespace kiln::kq;

constexpr int kMaxMB = 4;

struct Problem {
  int64_t fmt, M, N, S;
  const uint8_t* qs;      // [T, S, super_bytes]
  const uint8_t* sc;      // [T, S, scale_bytes]
  const int8_t* xq;       // [M, S * 256] int8 activations
  const float* xd;        // [M, S * 8] their scale per group of 32
  const float* xs;        // [M, S * 8] xd * the group's int8 sum
  const int32_t* xh;      // [M, S * 8, 2] 32 * the int8 sum of each half of the group (Q6_K's offset)
  const float* bias;      // [T * 16] or nullptr
  void* out;              // [M, N]
  bool out_bf16;
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  store_tile_row(p.out, p.out_bf16, p.N, p.bias, m, t, acc);
}

// ---------------------------------------------------------------- scalar reference

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  const int f = static_cast<int>(p.fmt);
  const int64_t QS = super_bytes(f), SB = scale_bytes(f), Kp = p.S * kSuper, G8 = p.S * 8;
  for (int64_t jr = 0; jr < mb; ++jr) {
    const int64_t m = m0 + jr;
    float acc[kRows] = {};
    for (int64_t s = 0; s < p.S; ++s) {
      const uint8_t* sb = p.sc + (t * p.S + s) * SB;
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qg = p.qs + (t * p.S + s) * QS + j * group_bytes(f);
        const int64_t g = m * G8 + s * 8 + j;
        const int8_t* xg = p.xq + m * Kp + (s * 8 + j) * kGroup;
        const float xd = p.xd[g];
        for (int r = 0; r < kRows; ++r) {
          int32_t lo = 0, hi = 0;
          for (int k = 0; k < 16; ++k) {
            lo += code_unsigned(f, qg, r, k) * xg[k];
            hi += code_unsigned(f, qg, r, 16 + k) * xg[16 + k];
          }
          const float d = half_bits_to_float(load_u16(sb + 2 * r));
          if (f == Q6K) {
            const float s0 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j) * 16 + r]));
            const float s1 = d * static_cast<float>(static_cast<int8_t>(sb[32 + (2 * j + 1) * 16 + r]));
            acc[r] = std::fma(static_cast<float>(lo - p.xh[2 * g]), s0 * xd, acc[r]);
            acc[r] = std::fma(static_cast<float>(hi - p.xh[2 * g + 1]), s1 * xd, acc[r]);
          } else {
            int sc, mn;
            scale_min_scalar(sb, r, j, sc, mn);
            const float dmin = half_bits_to_float(load_u16(sb + 32 + 2 * r));
            const float a = std::fma(static_cast<float>(lo + hi), (d * static_cast<float>(sc)) * xd, acc[r]);
            acc[r] = std::fma(-(dmin * static_cast<float>(mn)), p.xs[g], a);
          }
        }
      }
    }
    store(p, m, t, acc);
  }
}

#ifdef KILN_KQ_X86
#define KILN_KQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

inline int32_t load_i32(const int8_t* b) {
  int32_t v;
  std::memcpy(&v, b, 4);
  return v;
}

// ------------------------------------------------------------ AVX512-VNNI: a tile's 16 rows in one vector

template <int F, int NT, int MB>
KILN_KQ_VNNI void tiles_vnni(const Problem& p, int64_t t, int64_t m0, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t Kp = p.S * kSuper, G8 = p.S * 8;
  const __m512i m15 = _mm512_set1_epi8(15);
  __m512 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < p.S; ++s) {
    __m512 f0[NT][8], f1[NT][8];
    for (int a = 0; a < NT; ++a) scales_avx512<F>(p.sc + ((t + a) * p.S + s) * SB, f0[a], f1[a]);
    for (int g = 0; g < 8; ++g) {
      for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, p.S, t + a, s, g, NT);
      __m512i il[NT][MB], ih[NT][MB];
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) il[a][j] = ih[a][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i vl[NT], vh[NT];
        for (int a = 0; a < NT; ++a) {
          codes_avx512<F, false>(p.qs + ((t + a) * p.S + s) * QS + g * QB, c, vl[a], vh[a]);
          if (F == Q4K) {   // codes_avx512 leaves Q4_K's nibble pairs together
            vh[a] = _mm512_and_si512(_mm512_srli_epi16(vl[a], 4), m15);
            vl[a] = _mm512_and_si512(vl[a], m15);
          }
        }
        for (int j = 0; j < MB; ++j) {
          const int8_t* xg = p.xq + (m0 + j) * Kp + (s * 8 + g) * kGroup;
          const __m512i xl = _mm512_set1_epi32(load_i32(xg + 4 * c));
          const __m512i xh = _mm512_set1_epi32(load_i32(xg + 16 + 4 * c));
          for (int a = 0; a < NT; ++a) {
            il[a][j] = _mm512_dpbusd_epi32(il[a][j], vl[a], xl);
            ih[a][j] = _mm512_dpbusd_epi32(ih[a][j], vh[a], xh);
          }
        }
      }
      for (int j = 0; j < MB; ++j) {
        const int64_t gi = (m0 + j) * G8 + s * 8 + g;
        const __m512 xd = _mm512_set1_ps(p.xd[gi]);
        for (int a = 0; a < NT; ++a) {
          if (F == Q6K) {
            const __m512i lo = _mm512_sub_epi32(il[a][j], _mm512_set1_epi32(p.xh[2 * gi]));
            const __m512i hi = _mm512_sub_epi32(ih[a][j], _mm512_set1_epi32(p.xh[2 * gi + 1]));
            acc[a][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(f0[a][g], xd), acc[a][j]);
            acc[a][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(f1[a][g], xd), acc[a][j]);
          } else {
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(il[a][j], ih[a][j]));
            const __m512 v = _mm512_fmadd_ps(sum, _mm512_mul_ps(f0[a][g], xd), acc[a][j]);
            acc[a][j] = _mm512_fmadd_ps(f1[a][g], _mm512_set1_ps(p.xs[gi]), v);
          }
        }
      }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm512_storeu_ps(out[a][j], acc[a][j]);
}

// ------------------------------------------------------------ AVX2: half h of a tile (8 rows) a vector

// maddubs pairs an unsigned code byte with a signed activation byte into int16: at most 2 * 63 * 128 in
// magnitude (no saturation), and Q4_K / Q5_K's low and high halves add up to at most 2 * 2 * 31 * 128.
template <int F, int NT, int MB>
KILN_KQ_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0, int h, float (*out)[kMaxMB][kRows]) {
  constexpr int64_t QB = group_bytes(F), QS = super_bytes(F), SB = scale_bytes(F);
  const int64_t Kp = p.S * kSuper, G8 = p.S * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NT][MB];
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) acc[a][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < p.S; ++s) {
    __m256 f0[NT][8], f1[NT][8];
    for (int a = 0; a < NT; ++a) scales_avx2<F>(p.sc + ((t + a) * p.S + s) * SB, h, f0[a], f1[a]);
    for (int g = 0; g < 8; ++g) {
      if (h == 0)
        for (int a = 0; a < NT; ++a) prefetch_ahead<F>(p.qs, p.sc, p.S, t + a, s, g, NT);
      __m256i il[NT][MB], ih[NT][MB];
      for (int a = 0; a < NT; ++a)
        for (int j = 0; j < MB; ++j) il[a][j] = ih[a][j] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i vl[NT], vh[NT];
        for (int a = 0; a < NT; ++a) codes_avx2<F, false>(p.qs + ((t + a) * p.S + s) * QS + g * QB, c, h, vl[a], vh[a]);
        for (int j = 0; j < MB; ++j) {
          const int8_t* xg = p.xq + (m0 + j) * Kp + (s * 8 + g) * kGroup;
          const __m256i xl = _mm256_set1_epi32(load_i32(xg + 4 * c));
          const __m256i xh = _mm256_set1_epi32(load_i32(xg + 16 + 4 * c));
          for (int a = 0; a < NT; ++a) {
            const __m256i pl = _mm256_maddubs_epi16(vl[a], xl), ph = _mm256_maddubs_epi16(vh[a], xh);
            if (F == Q6K) {
              il[a][j] = _mm256_add_epi32(il[a][j], _mm256_madd_epi16(pl, ones));
              ih[a][j] = _mm256_add_epi32(ih[a][j], _mm256_madd_epi16(ph, ones));
            } else {
              il[a][j] = _mm256_add_epi32(il[a][j], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
            }
          }
        }
      }
      for (int j = 0; j < MB; ++j) {
        const int64_t gi = (m0 + j) * G8 + s * 8 + g;
        const __m256 xd = _mm256_set1_ps(p.xd[gi]);
        for (int a = 0; a < NT; ++a) {
          if (F == Q6K) {
            const __m256i lo = _mm256_sub_epi32(il[a][j], _mm256_set1_epi32(p.xh[2 * gi]));
            const __m256i hi = _mm256_sub_epi32(ih[a][j], _mm256_set1_epi32(p.xh[2 * gi + 1]));
            acc[a][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(f0[a][g], xd), acc[a][j]);
            acc[a][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(f1[a][g], xd), acc[a][j]);
          } else {
            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il[a][j]), _mm256_mul_ps(f0[a][g], xd), acc[a][j]);
            acc[a][j] = _mm256_fmadd_ps(f1[a][g], _mm256_set1_ps(p.xs[gi]), v);
          }
        }
      }
    }
  }
  for (int a = 0; a < NT; ++a)
    for (int j = 0; j < MB; ++j) _mm256_storeu_ps(out[a][j] + 8 * h, acc[a][j]);
}

// Tiles [t0, t1) for every activation row, in blocks of up to 4 rows: one row reads several tiles side
// by side (independent chains hide the dot products' latency), more rows share each code vector.
template <int F>
void run_x86(const Problem& p, int64_t t0, int64_t t1, bool vnni) {
  float out[4][kMaxMB][kRows];
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
    const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
    const int want = vnni ? (mb == 1 ? 4 : mb == 2 ? 2 : 1) : (mb == 1 ? 2 : 1);
    for (int64_t t = t0; t < t1;) {
      const int nt = t1 - t >= want ? want : 1;
      if (vnni) {
        if (nt == 4) tiles_vnni<F, 4, 1>(p, t, m0, out);
        else if (nt == 2) tiles_vnni<F, 2, 2>(p, t, m0, out);
        else if (mb == 1) tiles_vnni<F, 1, 1>(p, t, m0, out);
        else if (mb == 2) tiles_vnni<F, 1, 2>(p, t, m0, out);
        else if (mb == 3) tiles_vnni<F, 1, 3>(p, t, m0, out);
        else tiles_vnni<F, 1, 4>(p, t, m0, out);
      } else {
        for (int h = 0; h < 2; ++h) {
          if (nt == 2) tiles_avx2<F, 2, 1>(p, t, m0, h, out);
          else if (mb == 1) tiles_avx2<F, 1, 1>(p, t, m0, h, out);
          else if (mb == 2) tiles_avx2<F, 1, 2>(p, t, m0, h, out);
          else if (mb == 3) tiles_avx2<F, 1, 3>(p, t, m0, h, out);
          else tiles_avx2<F, 1, 4>(p, t, m0, h, out);
        }
      }
      for (int a = 0; a < nt; ++a)
        for (int j = 0; j < mb; ++j) store(p, m0 + j, t + a, out[a][j]);
      t += nt;
    }
  }
}
#endif

}  // namespace

namespace kiln {

torch::Tensor qlinear_kquant_q8_2d(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& scales,
                                   int64_t fmt, int64_t n, const c10::optional<torch::Tensor>& bias, int64_t isa,
                                   bool out_float) {
  const int64_t M = x.size(0), K = x.size(1), S = K / kSuper, G8 = S * 8;
  const int f = static_cast<int>(fmt);
  const int64_t T = qs.size(0);
  const int64_t level = resolve_isa(isa, "kiln qlinear_kquant");
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto y = torch::empty({M, n}, x.options().dtype(out_float || !bf16 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;

  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs;
  thread_local std::vector<int32_t> xh;
  xq.resize(static_cast<size_t>(M * K));
  xd.resize(static_cast<size_t>(M * G8));
  xs.resize(static_cast<size_t>(M * G8));
  quantize_activation_rows(level, x.data_ptr(), bf16, M, K, xq.data(), xd.data(), xs.data());
  if (f == Q6K) {
    xh.resize(static_cast<size_t>(M * G8 * 2));
    for (int64_t g = 0; g < M * G8; ++g)
      for (int h = 0; h < 2; ++h) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += xq[g * kGroup + 16 * h + i];
        xh[2 * g + h] = 32 * sum;
      }
  }
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "kiln qlinear_kquant: bias must have n elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  const Problem p{fmt, M, n, S, qs.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), xq.data(), xd.data(), xs.data(),
                  f == Q6K ? xh.data() : nullptr, bias_pad.empty() ? nullptr : bias_pad.data(), y.data_ptr(),
                  y.scalar_type() == torch::kBFloat16};
  const bool vnni = level >= ISA_AVX512 && cpu_has_avx512_vnni();
  const int64_t chunk = kquant_chunk_tiles(T, S * (super_bytes(f) + scale_bytes(f)));
  parallel_tasks((T + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t t0 = c * chunk, t1 = std::min(T, t0 + chunk);
#ifdef KILN_KQ_X86
    if (level >= ISA_AVX2) {
      if (f == Q4K) return run_x86<Q4K>(p, t0, t1, vnni);
      if (f == Q5K) return run_x86<Q5K>(p, t0, t1, vnni);
      return run_x86<Q6K>(p, t0, t1, vnni);
    }
#endif
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += kMaxMB) tile_scalar(p, t, m0, std::min<int64_t>(kMaxMB, M - m0));
  });
  return y;
}

}  // namespace kiln
