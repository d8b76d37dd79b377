// Dense bfloat16 linear layers for the serving path: y = x @ W^T with W in 16-row tiles whose K
// elements come in pairs (tiled by kiln/model/dense_tiles.py), the layout of AVX512-BF16's vdpbf16ps
// (each 32-bit lane holds one output row's two weights; one broadcast of two activations advances 16
// rows by two K steps).
//
// torch's bfloat16 GEMV on CPU streams weights at 8-10 GB/s (and a CPU without native bf16 dot
// products has only float32 GEMMs, twice the bytes); this reads bfloat16 once per call for up to 8
// activation rows and runs on the kernels' thread pool. Every output element is one float32 chain
// over the K pairs in order, whatever M, the row block, the tile group or the thread: a row's result
// never depends on the batch it shares (concurrent requests equal sequential ones). The three code
// paths compute the same bits:
//   - AVX512-BF16: vdpbf16ps adds the odd element's product to the accumulator, then the even one's,
//     rounding to nearest even each time, denormals flushed (inputs and results).
//   - AVX2 (+FMA; also AVX-512 CPUs without BF16): the weights widen in registers (a bfloat16 is the
//     top half of a float32: one shift or mask per 8 values, never a float32 copy in memory), then
//     two FMAs in the same order. A bfloat16 product is exact in float32, so fma(w, x, acc) rounds
//     exactly as the instruction's add does; MXCSR's FTZ/DAZ flush denormals like it.
//   - scalar: the same operations one at a time (the reference the others are tested against).
// A decode step has one activation row: its 16 rows of a tile are one or two dependency chains, so
// the vector paths run several tiles side by side to keep the FMA units busy (chain latency, not
// bandwidth, bounded the one-tile loop).

#include "dense_bf16.h"

#include "isa.h"
#include "qlinear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define KILN_BF16_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;
constexpr int kMaxMB = 8;
// K pairs (64 bytes of a tile each) a tile's stream is prefetched ahead: the tiles of a group are
// separate streams, each of which the hardware prefetcher would pick up only after a few misses
constexpr int64_t kAheadPairs = 32;

using kiln::bf16_bits_to_float;
using kiln::float_to_bf16_bits;
using kiln::half_bits_to_float;

inline float flush_denormal(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Problem {
  int64_t M, N, P;            // rows, outputs, K pairs
  const uint16_t* x;          // [M, 2P] (K padded to even)
  const float* xf;            // [M, 2P] x widened, denormals flushed (AVX2 path only)
  const uint16_t* tiles;      // [T, P, 32]
  const float* bias;          // [T*16] or nullptr
  uint16_t* y;                // [M, N] bfloat16, or
  float* yf;                  // [M, N] float32 (the sums unrounded)
  int64_t tile0 = 0;          // the tile `tiles` starts at (coded weights: a decoded run of tiles)
};

inline void store(const Problem& p, int64_t m, int64_t t, const float* acc) {
  const int64_t n0 = t * kRows, cnt = std::min<int64_t>(kRows, p.N - n0);
  for (int64_t r = 0; r < cnt; ++r) {
    const float v = acc[r] + (p.bias ? p.bias[n0 + r] : 0.0f);
    if (p.yf) {
      p.yf[m * p.N + n0 + r] = v;
    } else {
      p.y[m * p.N + n0 + r] = float_to_bf16_bits(v);
    }
  }
}

void tile_scalar(const Problem& p, int64_t t, int64_t m0, int64_t mb) {
  const uint16_t* w = p.tiles + (t - p.tile0) * p.P * 32;
  for (int64_t j = 0; j < mb; ++j) {
    const uint16_t* x = p.x + (m0 + j) * p.P * 2;
    float acc[kRows] = {};
    for (int64_t q = 0; q < p.P; ++q) {
      const float x0 = flush_denormal(bf16_bits_to_float(x[2 * q]));
      const float x1 = flush_denormal(bf16_bits_to_float(x[2 * q + 1]));
      for (int r = 0; r < kRows; ++r) {
        const float w0 = flush_denormal(bf16_bits_to_float(w[q * 32 + 2 * r]));
        const float w1 = flush_denormal(bf16_bits_to_float(w[q * 32 + 2 * r + 1]));
        // the instruction's order: the odd element's product added first, then the even one's
        acc[r] = flush_denormal(flush_denormal(acc[r] + w1 * x1) + w0 * x0);
      }
    }
    store(p, m0 + j, t, acc);
  }
}

// Tiles [t0, t1) for rows [m0, m0 + mb) on the scalar path.
void run_scalar(const Problem& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) tile_scalar(p, t, m0, std::min<int64_t>(kMaxMB, p.M - m0));
}

#ifdef KILN_BF16_X86
#define KILN_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define KILN_BF16_AVX2 __attribute__((target("avx2,fma,f16c")))

// ---------------------------------------------------------------- AVX512-BF16

// NT tiles' accumulators for MB rows, into y.
template <int NT, int MB>
KILN_BF16 void store_avx512(const Problem& p, __m512 (&acc)[NT][MB], int64_t t, int64_t m0) {
  alignas(64) float out[kRows];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) {
      _mm512_store_ps(out, acc[i][j]);
      store(p, m0 + j, t + i, out);
    }
}

// NT tiles from t, MB rows from m0: NT * MB independent chains.
template <int NT, int MB>
KILN_BF16 void tiles_avx512(const Problem& p, int64_t t, int64_t m0) {
  const uint16_t* w = p.tiles + (t - p.tile0) * p.P * 32;
  const int64_t tile = p.P * 32;
  __m512 acc[NT][MB];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * p.P * 2;
  for (int64_t q = 0; q < p.P; ++q) {
    __m512bh xv[MB];
    for (int j = 0; j < MB; ++j) {
      int32_t pair;
      std::memcpy(&pair, x + j * p.P * 2 + 2 * q, 4);
      xv[j] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int i = 0; i < NT; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i * tile + (q + kAheadPairs) * 32), _MM_HINT_T0);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * tile + q * 32);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  store_avx512<NT, MB>(p, acc, t, m0);
}

// Rows [0, M) of tiles [t0, t1): groups of tiles side by side for few rows, row blocks for many.
template <int NT1, int NT2, int NT4, int NT8>
void run_blocks(const Problem& p, int64_t t0, int64_t t1, void (*fn)(int nt, int mb, const Problem&, int64_t, int64_t)) {
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxMB) {
    const int mb = static_cast<int>(std::min<int64_t>(kMaxMB, p.M - m0));
    const int nt = mb == 1 ? NT1 : mb == 2 ? NT2 : mb <= 4 ? NT4 : NT8;
    int64_t t = t0;
    for (; t + nt <= t1; t += nt) fn(nt, mb, p, t, m0);
    for (; t < t1; ++t) fn(1, mb, p, t, m0);
  }
}

void dispatch_avx512(int nt, int mb, const Problem& p, int64_t t, int64_t m0) {
#define KILN_CASE(NT, MB) \
  if (nt == NT && mb == MB) return tiles_avx512<NT, MB>(p, t, m0);
  KILN_CASE(8, 1) KILN_CASE(4, 2) KILN_CASE(2, 3) KILN_CASE(2, 4)
  KILN_CASE(1, 1) KILN_CASE(1, 2) KILN_CASE(1, 3) KILN_CASE(1, 4)
  KILN_CASE(1, 5) KILN_CASE(1, 6) KILN_CASE(1, 7) KILN_CASE(1, 8)
#undef KILN_CASE
  for (int i = 0; i < nt; ++i) dispatch_avx512(1, mb, p, t + i, m0);
}

void run_avx512(const Problem& p, int64_t t0, int64_t t1) {
  run_blocks<8, 4, 2, 1>(p, t0, t1, dispatch_avx512);
}

// ---------------------------------------------------------------- AVX2 (+FMA)

// NT tiles from t, MB rows from m0 (MB <= 4): two ymm accumulators (rows 0-7, 8-15) per tile and row.
template <int NT, int MB>
KILN_BF16_AVX2 void tiles_avx2(const Problem& p, int64_t t, int64_t m0) {
  const uint16_t* w = p.tiles + (t - p.tile0) * p.P * 32;
  const int64_t tile = p.P * 32;
  const int64_t xs = p.P * 2;
  const float* x = p.xf + m0 * xs;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[NT][MB][2];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t q = 0; q < p.P; ++q) {
    for (int i = 0; i < NT; ++i) {
      const uint16_t* wq = w + i * tile + q * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wq + kAheadPairs * 32), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 16));
      // lane r holds (W[r, 2q], W[r, 2q + 1]): the even weight is the low half, the odd one the high
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
      for (int j = 0; j < MB; ++j) {
        const __m256 x0 = _mm256_broadcast_ss(x + j * xs + 2 * q);
        const __m256 x1 = _mm256_broadcast_ss(x + j * xs + 2 * q + 1);
        acc[i][j][0] = _mm256_fmadd_ps(e0, x0, _mm256_fmadd_ps(o0, x1, acc[i][j][0]));
        acc[i][j][1] = _mm256_fmadd_ps(e1, x0, _mm256_fmadd_ps(o1, x1, acc[i][j][1]));
      }
    }
  }
  alignas(32) float out[kRows];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) {
      _mm256_store_ps(out, acc[i][j][0]);
      _mm256_store_ps(out + 8, acc[i][j][1]);
      store(p, m0 + j, t + i, out);
    }
}

void dispatch_avx2(int nt, int mb, const Problem& p, int64_t t, int64_t m0) {
  if (mb > 4) {   // two blocks of rows, each re-reading the tile from L1
    dispatch_avx2(nt, 4, p, t, m0);
    return dispatch_avx2(nt, mb - 4, p, t, m0 + 4);
  }
#define KILN_CASE(NT, MB) \
  if (nt == NT && mb == MB) return tiles_avx2<NT, MB>(p, t, m0);
  KILN_CASE(4, 1) KILN_CASE(2, 2) KILN_CASE(1, 1) KILN_CASE(1, 2) KILN_CASE(1, 3) KILN_CASE(1, 4)
#undef KILN_CASE
  for (int i = 0; i < nt; ++i) dispatch_avx2(1, mb, p, t + i, m0);
}

// Denormal inputs read as zero and denormal results become zero, as in vdpbf16ps.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

void run_avx2(const Problem& p, int64_t t0, int64_t t1) {
  FlushDenormals ftz;
  run_blocks<4, 2, 1, 1>(p, t0, t1, dispatch_avx2);
}

KILN_BF16_AVX2 void widen_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  const __m256i exp = _mm256_set1_epi32(0x7F800000);
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16);
    // denormals (exponent 0) flushed to a signed zero, as the bf16 instruction reads them
    const __m256i denormal = _mm256_cmpeq_epi32(_mm256_and_si256(w, exp), _mm256_setzero_si256());
    const __m256i v = _mm256_andnot_si256(_mm256_and_si256(denormal, _mm256_set1_epi32(0x7FFFFFFF)), w);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(v));
  }
  for (; i < n; ++i) dst[i] = flush_denormal(bf16_bits_to_float(src[i]));
}
#endif

enum Path { SCALAR, AVX2, AVX512_BF16 };

Path path_for(int64_t isa) {
  if (isa >= kiln::ISA_AVX512 && kiln::cpu_has_avx512_bf16()) return AVX512_BF16;
  if (isa >= kiln::ISA_AVX2) return AVX2;
  return SCALAR;
}

// ---------------------------------------------------------------- coded tiles
// A bfloat16 weight that is a GGUF's Q4_0 / Q4_1 / Q8_0 blocks dequantized (every value bf16(d*q + m)
// or bf16(d*q), the float32 value rounded to nearest even) can stay in its codes: a third of the
// bytes, and each value is rebuilt in registers bit for bit, then multiplied exactly as above. A decode
// step streams the weights once, so fewer bytes is a faster step wherever memory bounds it; the
// outputs are the dense kernel's, bit for bit, on every path (tested against the bfloat16 tiles).
//
// Layout, per tile t (16 output rows) and group g (32 K values, 16 K pairs q):
//   kind 0 (4-bit): codes [T, G, 16, 16]: byte [t, g, q, r] = c(16t + r, 32g + 2q) | c(.., 32g + 2q + 1) << 4;
//                   scales float16 [T, G, 32]: the 16 rows' d, then their m; w = bf16(fma(d, c, m)).
//   kind 1 (int8):  codes [T, G, 16, 32]: byte [t, g, q, 16e + r] = c(16t + r, 32g + 2q + e) (int8);
//                   scales float16 [T, G, 16]: d; w = bf16(d * c).
// fma(d, c, m) is d*c + m rounded once, as the float32 dequantization computes it (d*c is exact: an
// 11-bit significand times a 4- or 8-bit integer). Rows past n have codes 0 and d = m = 0.

struct Coded {
  int64_t kind;             // 0: 4-bit codes with d and m; 1: int8 codes with d
  int64_t G;                // groups of 32 along K
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t code_bytes() const { return kind == 0 ? 256 : 512; }
  int64_t scale_halfs() const { return kind == 0 ? 32 : 16; }
  const uint8_t* group_codes(int64_t t, int64_t g) const { return codes + (t * G + g) * code_bytes(); }
  const uint16_t* group_scales(int64_t t, int64_t g) const { return scales + (t * G + g) * scale_halfs(); }
};

// bytes of a tile's codes the register loop prefetches ahead of itself (each tile is its own stream).
// Aimed into the tile the pass reads next once past a tile's end (a 576-wide q4_1 tile is 4.6 KB, so
// 4 KB ahead of one of 4 tiles side by side had landed in its neighbour, read beside it already):
// the embedded model's one-row AVX512-BF16 step 8.4-8.8 -> 7.0-7.3 ms (p50, 2-core Intel Xeon);
// 2 KB ahead 7.1-7.9, 8 KB 7.6-7.9.
constexpr int64_t kCodedAheadBytes = 4096;


// Tile t's bfloat16 values in the dense layout (dst [P, 32]).
void decode_tile_scalar(const Coded& c, int64_t t, uint16_t* dst) {
  for (int64_t g = 0; g < c.G; ++g) {
    const uint8_t* cb = c.group_codes(t, g);
    const uint16_t* s = c.group_scales(t, g);
    for (int r = 0; r < kRows; ++r) {
      const float d = half_bits_to_float(s[r]);
      const float m = c.kind == 0 ? half_bits_to_float(s[kRows + r]) : 0.0f;
      for (int q = 0; q < 16; ++q)
        for (int e = 0; e < 2; ++e) {
          const float w = c.kind == 0 ? std::fma(d, static_cast<float>((cb[q * 16 + r] >> (4 * e)) & 15), m)
                                      : d * static_cast<float>(static_cast<int8_t>(cb[q * 32 + e * 16 + r]));
          dst[(g * 16 + q) * 32 + 2 * r + e] = float_to_bf16_bits(w);
        }
    }
  }
}

#ifdef KILN_BF16_X86
// A float32 rounded to bfloat16 precision (nearest even), as a float32: adding 1.5 * 2^(e+16) puts the
// value's bfloat16 ulp, 2^(e-7), at the sum's last place, so the add rounds it; subtracting gives it
// back exactly. Weights here are 0 or at least 2^-24 in magnitude, far from denormals and overflow.
KILN_BF16_AVX2 inline __m256 round_bf16_avx2(__m256 w) {
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(w), _mm256_set1_epi32(0x7F800000));
  const __m256 c = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32((16 << 23) | 0x400000)));
  return _mm256_sub_ps(_mm256_add_ps(w, c), c);
}

KILN_BF16_AVX2 inline __m256 int8_floats_avx2(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Pair q of a group: the even and odd K values of rows 0-7 (e0, o0) and 8-15 (e1, o1), rounded.
template <int64_t KIND>
KILN_BF16_AVX2 inline void decode_pair_avx2(const uint8_t* cb, int q, const __m256* dm, __m256* w) {
  if constexpr (KIND == 0) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + q * 16));
    const __m256i v0 = _mm256_cvtepu8_epi32(b), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low = _mm256_set1_epi32(15);
    w[0] = round_bf16_avx2(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), dm[0], dm[2]));
    w[1] = round_bf16_avx2(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), dm[0], dm[2]));
    w[2] = round_bf16_avx2(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), dm[1], dm[3]));
    w[3] = round_bf16_avx2(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), dm[1], dm[3]));
  } else {
    const uint8_t* p = cb + q * 32;
    w[0] = round_bf16_avx2(_mm256_mul_ps(int8_floats_avx2(p), dm[0]));
    w[1] = round_bf16_avx2(_mm256_mul_ps(int8_floats_avx2(p + 16), dm[0]));
    w[2] = round_bf16_avx2(_mm256_mul_ps(int8_floats_avx2(p + 8), dm[1]));
    w[3] = round_bf16_avx2(_mm256_mul_ps(int8_floats_avx2(p + 24), dm[1]));
  }
}

// d for rows 0-7, 8-15, then m for them (kind 1: m unused).
template <int64_t KIND>
KILN_BF16_AVX2 inline void group_scales_avx2(const uint16_t* s, __m256* dm) {
  dm[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  dm[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
  if constexpr (KIND == 0) {
    dm[2] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
    dm[3] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 24)));
  }
}

template <int64_t KIND>
KILN_BF16_AVX2 void decode_tile_avx2(const Coded& c, int64_t t, uint16_t* dst) {
  for (int64_t g = 0; g < c.G; ++g) {
    const uint8_t* cb = c.group_codes(t, g);
    __m256 dm[4];
    group_scales_avx2<KIND>(c.group_scales(t, g), dm);
    for (int q = 0; q < 16; ++q) {
      __m256 w[4];
      decode_pair_avx2<KIND>(cb, q, dm, w);
      // dword r = (even, odd): the even value's top half low, the odd one's (low half zero) high
      for (int h = 0; h < 2; ++h) {
        const __m256i pair = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(w[2 * h]), 16),
                                             _mm256_castps_si256(w[2 * h + 1]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (g * 16 + q) * 32 + 16 * h), pair);
      }
    }
  }
}

// The 16 rows' (even, odd) pairs of pair q as vdpbf16ps takes them.
template <int64_t KIND>
KILN_BF16 inline __m512bh decode_pair_avx512(const uint8_t* cb, int q, __m512 d, __m512 m) {
  __m512 e, o;
  if constexpr (KIND == 0) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + q * 16)));
    e = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d, m);
    o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
  } else {
    const uint8_t* p = cb + q * 32;
    e = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), d);
    o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), d);
  }
  // words 0-15 the even values, 16-31 the odd ones (rounded to nearest even); interleaved per row
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                       23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return (__m512bh)_mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(o, e));
}

template <int64_t KIND>
KILN_BF16 inline void group_scales_avx512(const uint16_t* s, __m512* d, __m512* m) {
  *d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  *m = KIND == 0 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16))) : _mm512_setzero_ps();
}

template <int64_t KIND>
KILN_BF16 void decode_tile_avx512(const Coded& c, int64_t t, uint16_t* dst) {
  for (int64_t g = 0; g < c.G; ++g) {
    __m512 d, m;
    group_scales_avx512<KIND>(c.group_scales(t, g), &d, &m);
    for (int q = 0; q < 16; ++q)
      _mm512_storeu_si512(dst + (g * 16 + q) * 32, (__m512i)decode_pair_avx512<KIND>(c.group_codes(t, g), q, d, m));
  }
}

// MB activation rows over NT tiles from t: the dot products of tiles_avx512, each pair decoded once.
template <int64_t KIND, int NT, int MB>
KILN_BF16 void coded_rows_avx512(const Problem& p, const Coded& c, int64_t t, int64_t m0) {
  __m512 acc[NT][MB];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint16_t* x = p.x + m0 * p.P * 2;
  for (int64_t g = 0; g < c.G; ++g) {
    __m512 d[NT], m[NT];
    for (int i = 0; i < NT; ++i) {
      group_scales_avx512<KIND>(c.group_scales(t + i, g), &d[i], &m[i]);
      // kCodedAheadBytes of codes ahead in this tile's stream, or in the tile this pass reads next
      const int64_t at = kiln::group_ahead(t + i, g, c.G, kCodedAheadBytes / c.code_bytes(), NT);
      for (int64_t b = 0; b < c.code_bytes(); b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(c.codes + at * c.code_bytes() + b), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c.scales + at * c.scale_halfs()), _MM_HINT_T0);
    }
    for (int q = 0; q < 16; ++q) {
      __m512bh xv[MB];
      for (int j = 0; j < MB; ++j) {
        int32_t pair;
        std::memcpy(&pair, x + j * p.P * 2 + 2 * (g * 16 + q), 4);
        xv[j] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int i = 0; i < NT; ++i) {
        const __m512bh wv = decode_pair_avx512<KIND>(c.group_codes(t + i, g), q, d[i], m[i]);
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
      }
    }
  }
  store_avx512<NT, MB>(p, acc, t, m0);
}

template <int64_t KIND, int NT, int MB>
KILN_BF16 void coded_run_avx512(const Problem& p, const Coded& c, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + NT <= t1; t += NT) coded_rows_avx512<KIND, NT, MB>(p, c, t, 0);
  for (; t < t1; ++t) coded_rows_avx512<KIND, 1, MB>(p, c, t, 0);
}

template <int64_t KIND>
void coded_avx512(const Problem& p, const Coded& c, int64_t t0, int64_t t1) {
  switch (p.M) {
    case 1: return coded_run_avx512<KIND, 4, 1>(p, c, t0, t1);
    case 2: return coded_run_avx512<KIND, 2, 2>(p, c, t0, t1);
    case 3: return coded_run_avx512<KIND, 2, 3>(p, c, t0, t1);
    case 4: return coded_run_avx512<KIND, 2, 4>(p, c, t0, t1);
    case 5: return coded_run_avx512<KIND, 1, 5>(p, c, t0, t1);
    case 6: return coded_run_avx512<KIND, 1, 6>(p, c, t0, t1);
    case 7: return coded_run_avx512<KIND, 1, 7>(p, c, t0, t1);
    default: return coded_run_avx512<KIND, 1, 8>(p, c, t0, t1);
  }
}
#endif

// Tiles [t0, t1) of a coded weight. On AVX512-BF16 up to kMaxMB activation rows rebuild the weights in
// registers (once for all of them). Otherwise a run of tiles is decoded into `scratch` once and the
// dense kernel runs over it: what more rows, and AVX2 and scalar (where the loader serves tiles, not
// codes; these paths give the same bits for tests and forced ISAs), take.
void run_coded(Path path, const Problem& p, const Coded& c, int64_t t0, int64_t t1, std::vector<uint16_t>& scratch) {
#ifdef KILN_BF16_X86
  if (path == AVX512_BF16 && p.M <= kMaxMB) return c.kind == 0 ? coded_avx512<0>(p, c, t0, t1) : coded_avx512<1>(p, c, t0, t1);
#endif
  constexpr int64_t kRun = 8;   // tiles decoded at once: the dense kernel's widest group
  const int64_t tile = p.P * 32;
  scratch.resize(static_cast<size_t>(kRun * tile));
  for (int64_t r0 = t0; r0 < t1; r0 += kRun) {
    const int64_t r1 = std::min(t1, r0 + kRun);
    for (int64_t t = r0; t < r1; ++t) {
      uint16_t* dst = scratch.data() + (t - r0) * tile;
#ifdef KILN_BF16_X86
      if (path == AVX512_BF16) {
        c.kind == 0 ? decode_tile_avx512<0>(c, t, dst) : decode_tile_avx512<1>(c, t, dst);
        continue;
      }
      if (path == AVX2) {
        c.kind == 0 ? decode_tile_avx2<0>(c, t, dst) : decode_tile_avx2<1>(c, t, dst);
        continue;
      }
#endif
      decode_tile_scalar(c, t, dst);
    }
    Problem q = p;
    q.tiles = scratch.data();
    q.tile0 = r0;
#ifdef KILN_BF16_X86
    if (path == AVX512_BF16) { run_avx512(q, r0, r1); continue; }
    if (path == AVX2) { run_avx2(q, r0, r1); continue; }
#endif
    run_scalar(q, r0, r1);
  }
}

// y = x @ W^T for dense tiles (`tiles`) or coded ones (`coded`, then `tiles` is null).
torch::Tensor run_linear(const char* name, const torch::Tensor& x, const uint16_t* tiles, const Coded* coded,
                         int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float) {
  const int64_t T = (n + kRows - 1) / kRows, P = (k + 1) / 2;
  const Path path = path_for(kiln::resolve_isa(isa, name));
  const int64_t M = x.size(0);
  auto y = torch::empty({M, n}, x.options().dtype(out_float ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0 || n == 0) return y;
  // K padded to whole pairs (the padding weights are zero)
  auto xp = (k % 2 || !x.is_contiguous()) ? at::constant_pad_nd(x, {0, 2 * P - k}).contiguous() : x;
  const auto* xbits = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  torch::Tensor b;
  std::vector<float> bias_pad;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, name, ": bias must have n elements");
    b = bias->to(torch::kFloat32).contiguous();
    bias_pad.assign(static_cast<size_t>(T * kRows), 0.0f);
    std::memcpy(bias_pad.data(), b.data_ptr<float>(), sizeof(float) * n);
  }
  // the AVX2 path broadcasts float32 activations: widened once here (M x K, small next to W)
  thread_local std::vector<float> xf;
#ifdef KILN_BF16_X86
  if (path == AVX2) {
    xf.resize(static_cast<size_t>(M * 2 * P));
    widen_avx2(xbits, xf.data(), M * 2 * P);
  }
#endif
  const Problem p{M, n, P, xbits, xf.data(), tiles, bias_pad.empty() ? nullptr : bias_pad.data(),
                  out_float ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  out_float ? y.data_ptr<float>() : nullptr};
  // chunks of consecutive tiles, whole groups of 8 so a chunk's tiles run side by side
  const int64_t per_chunk = std::max<int64_t>(8, (T / 16 + 7) / 8 * 8);
  const int64_t chunks = (T + per_chunk - 1) / per_chunk;
  kiln::parallel_tasks(chunks, [&](int64_t c) {
    const int64_t t0 = c * per_chunk, t1 = std::min(T, t0 + per_chunk);
    if (coded != nullptr) {
      thread_local std::vector<uint16_t> scratch;   // a run of decoded tiles, kept across calls
      return run_coded(path, p, *coded, t0, t1, scratch);
    }
#ifdef KILN_BF16_X86
    if (path == AVX512_BF16) return run_avx512(p, t0, t1);
    if (path == AVX2) return run_avx2(p, t0, t1);
#endif
    run_scalar(p, t0, t1);
  });
  return y;
}

Coded coded_of(const char* name, const torch::Tensor& codes, const torch::Tensor& scales, int64_t kind, int64_t n,
               int64_t k) {
  TORCH_CHECK_VALUE(kind == 0 || kind == 1, name, ": kind must be 0 (4-bit codes) or 1 (int8 codes)");
  TORCH_CHECK_VALUE(k % 32 == 0, name, ": k must be a whole number of groups of 32");
  const int64_t T = (n + kRows - 1) / kRows, G = k / 32;
  TORCH_CHECK_VALUE(codes.dim() == 4 && codes.size(0) == T && codes.size(1) == G && codes.size(2) == 16 &&
                        codes.size(3) == (kind == 0 ? 16 : 32) && codes.is_contiguous() &&
                        (codes.scalar_type() == torch::kUInt8 || codes.scalar_type() == torch::kInt8),
                    name, ": codes do not match n, k and kind");
  TORCH_CHECK_VALUE(scales.dim() == 3 && scales.size(0) == T && scales.size(1) == G &&
                        scales.size(2) == (kind == 0 ? 32 : 16) && scales.is_contiguous() &&
                        scales.scalar_type() == torch::kFloat16,
                    name, ": scales do not match n, k and kind");
  return Coded{kind, G, static_cast<const uint8_t*>(codes.data_ptr()),
               reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>())};
}

}  // namespace

namespace kiln {

bool bf16_dot_supported() { return cpu_has_avx512_bf16(); }

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& tiles, int64_t n, int64_t k,
                          const c10::optional<torch::Tensor>& bias, int64_t isa, bool out_float) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
                    "kiln linear_bf16: x must be a [M, k] bfloat16 CPU tensor");
  const int64_t T = (n + kRows - 1) / kRows, P = (k + 1) / 2;
  TORCH_CHECK_VALUE(tiles.dim() == 3 && tiles.size(0) == T && tiles.size(1) == P && tiles.size(2) == 32 &&
                        tiles.is_contiguous() && tiles.scalar_type() == torch::kBFloat16,
                    "kiln linear_bf16: tiles do not match n and k");
  return run_linear("kiln linear_bf16", x, reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), nullptr,
                    n, k, bias, isa, out_float);
}

torch::Tensor linear_bf16_coded(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                int64_t kind, int64_t n, int64_t k, const c10::optional<torch::Tensor>& bias,
                                int64_t isa, bool out_float) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
                    "kiln linear_bf16_coded: x must be a [M, k] bfloat16 CPU tensor");
  const Coded c = coded_of("kiln linear_bf16_coded", codes, scales, kind, n, k);
  return run_linear("kiln linear_bf16_coded", x, nullptr, &c, n, k, bias, isa, out_float);
}

torch::Tensor decode_coded_tiles(const torch::Tensor& codes, const torch::Tensor& scales, int64_t kind, int64_t n,
                                 int64_t k, int64_t isa) {
  const Coded c = coded_of("kiln decode_coded_tiles", codes, scales, kind, n, k);
  const Path path = path_for(resolve_isa(isa, "kiln decode_coded_tiles"));
  const int64_t T = (n + kRows - 1) / kRows, P = k / 2;
  auto tiles = torch::empty({T, P, 32}, torch::dtype(torch::kBFloat16));
  auto* dst = reinterpret_cast<uint16_t*>(tiles.data_ptr<at::BFloat16>());
  kiln::parallel_tasks(T, [&](int64_t t) {
    uint16_t* out = dst + t * P * 32;
#ifdef KILN_BF16_X86
    if (path == AVX512_BF16) return c.kind == 0 ? decode_tile_avx512<0>(c, t, out) : decode_tile_avx512<1>(c, t, out);
    if (path == AVX2) return c.kind == 0 ? decode_tile_avx2<0>(c, t, out) : decode_tile_avx2<1>(c, t, out);
#endif
    decode_tile_scalar(c, t, out);
  });
  return tiles;
}

}  // namespace kiln
