// The K-quant tiles' codec, load side: GGUF blocks into tiles (kquant_dequant.cpp turns tiles back into
// dense weights for the torch paths).
//
// Load: each row's superblock is rewritten as its row record (kiln/model/kquant.py's `_records`,
// documented there) and 16 rows' records are scattered into a tile by the byte permutation kquant.py
// computes (`_permutation`, passed in), codes into qs and the rest into scales. The numpy path this
// replaced took ~20 s of a 1B Q4_K_M model's load on two cores; this is one pass over the file's bytes,
// the tiles shared out on the kernels' pool, written straight into a fused weight's slice when given one.

#include "kquant_pack.h"

#include "kquant_tiles.h"
#include "qlinear.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kiln::kq;

int gguf_bytes(int f) { return f == Q4K ? 144 : f == Q5K ? 176 : 210; }

// Code i (0..31) of group j (0..7) of a GGUF superblock b, all bits (gguf.quants' unpacking).
inline int code(int f, const uint8_t* b, int j, int i) {
  if (f == Q6K) {
    const int half = j / 4, shift = (j / 2) % 2, part = j % 2;
    const int low = (b[half * 64 + part * 32 + i] >> (4 * shift)) & 15;
    const int high = (b[128 + half * 32 + i] >> (2 * (j % 4))) & 3;
    return low | (high << 4);
  }
  const uint8_t* qs = b + (f == Q5K ? 48 : 16);
  int q = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
  if (f == Q5K) q |= ((b[16 + i] >> j) & 1) << 4;
  return q;
}

// The row record of GGUF superblock b (kquant.py's `_records`).
void record(int f, const uint8_t* b, uint8_t* rec) {
  int q[8][32];
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) q[j][i] = code(f, b, j, i);
  const int nib0 = f == Q6K ? 18 : 16;
  if (f == Q6K) {
    rec[0] = b[208];
    rec[1] = b[209];
    std::memcpy(rec + 2, b + 192, 16);
  } else {
    std::memcpy(rec, b, 16);
  }
  for (int j = 0; j < 8; ++j)
    for (int k = 0; k < 16; ++k) rec[nib0 + 16 * j + k] = static_cast<uint8_t>((q[j][k] & 15) | ((q[j][16 + k] & 15) << 4));
  if (f == Q5K) {
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) {
        uint8_t v = 0;
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 4; ++c) v |= static_cast<uint8_t>(((q[j][16 * h + 4 * c + i] >> 4) & 1) << (4 * h + c));
        rec[144 + 4 * j + i] = v;
      }
  }
  if (f == Q6K) {
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          uint8_t v = 0;
          for (int c = 0; c < 4; ++c) v |= static_cast<uint8_t>(((q[j][16 * h + 4 * c + i] >> 4) & 3) << (2 * c));
          rec[146 + 8 * j + 4 * h + i] = v;
        }
  }
}


// The same tiles as `record` + kquant.py's permutation, written directly: each row's record is built
// in 32-bit words (its nibble words by SWAR over the GGUF bytes, its high-bit words by masks and
// shifts) and stored to the tile's word positions; the scale bytes are a 16-row byte transpose.
// A 1B Q4_K_M model's ~640 MB of blocks: ~0.3 s of CPU (AMD EPYC Zen 4) against ~1.1 s for the byte-wise
// record and gather (`record` below; the page faults of the new tiles, ~0.3 s of system time, aside).
// `kquant_tiles_from_gguf` checks the direct writes against the permutation on every call.

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// The record's 16 nibble bytes of the two groups whose codes share the GGUF bytes L[0..31] (low nibbles:
// group `even`, high nibbles: group `odd`) as 4 words each: record byte k = code k | code 16+k << 4.
inline void nibble_words(const uint8_t* L, uint32_t* even, uint32_t* odd) {
  constexpr uint64_t lo = 0x0F0F0F0F0F0F0F0FULL, hi = 0xF0F0F0F0F0F0F0F0ULL;
  for (int h = 0; h < 2; ++h) {
    const uint64_t a = load64(L + 8 * h), b = load64(L + 16 + 8 * h);
    const uint64_t e = (a & lo) | ((b & lo) << 4), o = ((a >> 4) & lo) | (b & hi);
    even[2 * h] = static_cast<uint32_t>(e);
    even[2 * h + 1] = static_cast<uint32_t>(e >> 32);
    odd[2 * h] = static_cast<uint32_t>(o);
    odd[2 * h + 1] = static_cast<uint32_t>(o >> 32);
  }
}

// Row r of a tile's superblock (codes q, scale bytes sc) from its GGUF block b.
void tile_row(int f, const uint8_t* b, int r, uint8_t* q, uint8_t* sc) {
  const int64_t gb = group_bytes(f);
  uint32_t nib[32];   // word 4j + c: record bytes nib0 + 16j + 4c .. +3
  const uint8_t* ql = f == Q6K ? b : b + (f == Q5K ? 48 : 16);
  for (int c2 = 0; c2 < 4; ++c2) {
    // Q4_K / Q5_K: bytes 32 c2.. hold groups 2 c2 (low) and 2 c2 + 1 (high); Q6_K: bytes 64 half + 32 part
    // hold groups 4 half + part (low) and 4 half + 2 + part (high)
    const int half = c2 / 2, part = c2 % 2;
    const int ge = f == Q6K ? 4 * half + part : 2 * c2, go = f == Q6K ? ge + 2 : 2 * c2 + 1;
    nibble_words(ql + 32 * c2, nib + 4 * ge, nib + 4 * go);
  }
  for (int j = 0; j < 8; ++j)
    for (int c = 0; c < 4; ++c) store32(q + j * gb + c * 64 + r * 4, nib[4 * j + c]);
  if (f == Q5K) {
    // bit 4 of code i of group j is bit j of qh[i]; record byte 4j + i, bit 4h + c: code 16h + 4c + i
    uint32_t qh[8];
    for (int m = 0; m < 8; ++m) qh[m] = load32(b + 16 + 4 * m);
    for (int j = 0; j < 8; ++j) {
      uint32_t v = 0;
      for (int m = 0; m < 8; ++m) v |= ((qh[m] >> j) & 0x01010101u) << m;
      store32(q + j * gb + 256 + r * 4, v);
    }
  }
  if (f == Q6K) {
    // bits 4-5 of code i of group j: bits 2 (j % 4) of qh[32 (j / 4) + i]; record byte 8j + 4h + i,
    // bits 2c: code 16h + 4c + i
    for (int j = 0; j < 8; ++j) {
      const uint8_t* H = b + 128 + 32 * (j / 4);
      const int shift = 2 * (j % 4);
      for (int h = 0; h < 2; ++h) {
        uint32_t v = 0;
        for (int c = 0; c < 4; ++c) v |= ((load32(H + 16 * h + 4 * c) >> shift) & 0x03030303u) << (2 * c);
        store32(q + j * gb + 256 + h * 64 + r * 4, v);
      }
    }
    sc[2 * r] = b[208];
    sc[2 * r + 1] = b[209];
    for (int k = 0; k < 16; ++k) sc[32 + k * 16 + r] = b[192 + k];
  } else {
    sc[2 * r] = b[0];
    sc[2 * r + 1] = b[1];
    sc[32 + 2 * r] = b[2];
    sc[32 + 2 * r + 1] = b[3];
    for (int k = 0; k < 12; ++k) sc[64 + k * 16 + r] = b[4 + k];
  }
}

}  // namespace

namespace kiln {

std::vector<torch::Tensor> kquant_tiles_from_gguf(const torch::Tensor& blocks, int64_t fmt, int64_t n, int64_t k,
                                                  const c10::optional<torch::Tensor>& rows, const torch::Tensor& perm,
                                                  int64_t super_bytes, const c10::optional<torch::Tensor>& out_qs,
                                                  const c10::optional<torch::Tensor>& out_scales) {
  TORCH_CHECK_VALUE(fmt >= Q4K && fmt <= Q6K, "kquant_tiles_from_gguf: unknown format ", fmt);
  const int f = static_cast<int>(fmt);
  const int64_t rb = gguf_bytes(f), S = k / 256;
  TORCH_CHECK_VALUE(k % 256 == 0, "kquant_tiles_from_gguf: k is not whole superblocks");
  TORCH_CHECK_VALUE(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
                    "kquant_tiles_from_gguf: blocks must be contiguous uint8");
  const int64_t src_rows = blocks.numel() / (S * rb);
  TORCH_CHECK_VALUE(blocks.numel() == src_rows * S * rb, "kquant_tiles_from_gguf: blocks are not whole rows");
  TORCH_CHECK_VALUE(perm.scalar_type() == torch::kLong && perm.numel() == kRows * rb && perm.is_contiguous(),
                    "kquant_tiles_from_gguf: the permutation has ", kRows * rb, " entries");
  TORCH_CHECK_VALUE(super_bytes == kiln::kq::super_bytes(f), "kquant_tiles_from_gguf: ", super_bytes,
                    " code bytes a superblock, expected ", kiln::kq::super_bytes(f));
  const int64_t* idx = nullptr;
  torch::Tensor rows_c;
  if (rows.has_value() && rows->defined()) {
    rows_c = rows->to(torch::kLong).contiguous();
    TORCH_CHECK_VALUE(rows_c.numel() == n, "kquant_tiles_from_gguf: ", rows_c.numel(), " rows for n = ", n);
    idx = rows_c.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK_VALUE(idx[r] >= 0 && idx[r] < src_rows, "kquant_tiles_from_gguf: row ", idx[r], " out of range");
  } else {
    TORCH_CHECK_VALUE(n == src_rows, "kquant_tiles_from_gguf: ", src_rows, " rows of blocks for n = ", n);
  }
  const int64_t T = (n + kRows - 1) / kRows, tb = kRows * rb, SB = tb - super_bytes;
  TORCH_CHECK_VALUE(SB == scale_bytes(f), "kquant_tiles_from_gguf: the tile's scale bytes do not add up");
  // out_qs / out_scales: where to write (a slice of tiles of a fused weight's storage), else new tensors
  auto output = [&](const c10::optional<torch::Tensor>& given, int64_t width, const char* what) {
    if (!given.has_value() || !given->defined()) return torch::empty({T, S, width}, blocks.options());
    const torch::Tensor& o = *given;
    TORCH_CHECK_VALUE(o.scalar_type() == torch::kUInt8 && o.is_contiguous() && o.dim() == 3 && o.size(0) == T &&
                      o.size(1) == S && o.size(2) == width, "kquant_tiles_from_gguf: ", what,
                      " must be a contiguous uint8 [", T, ", ", S, ", ", width, "] tensor");
    return o;
  };
  auto qs = output(out_qs, super_bytes, "out_qs"), scales = output(out_scales, SB, "out_scales");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* pm = perm.data_ptr<int64_t>();
  uint8_t* qd = qs.data_ptr<uint8_t>();
  uint8_t* sd = scales.data_ptr<uint8_t>();
  static const uint8_t zero_block[256] = {};   // rows past n: a zero record (d = 0)
  auto block = [&](int64_t row, int64_t s) -> const uint8_t* {
    if (row >= n) return zero_block;
    return src + ((idx ? idx[row] : row) * S + s) * rb;
  };
  // The first tile's first superblock the slow way, from kquant.py's permutation: the direct writes
  // below must give the same bytes (the layout has one definition, the permutation).
  if (T > 0 && S > 0) {
    std::vector<uint8_t> recs(static_cast<size_t>(tb)), want(static_cast<size_t>(tb)), got(static_cast<size_t>(tb));
    for (int r = 0; r < kRows; ++r) record(f, block(r, 0), recs.data() + r * rb);
    for (int64_t i = 0; i < tb; ++i) want[i] = recs[pm[i]];
    for (int r = 0; r < kRows; ++r) tile_row(f, block(r, 0), r, got.data(), got.data() + super_bytes);
    TORCH_CHECK(want == got, "kquant_tiles_from_gguf: the direct tile writes disagree with the permutation");
  }
  parallel_tasks(T, [&](int64_t t) {
    for (int64_t s = 0; s < S; ++s) {
      uint8_t* q = qd + (t * S + s) * super_bytes;
      uint8_t* sc = sd + (t * S + s) * SB;
      for (int r = 0; r < kRows; ++r) tile_row(f, block(t * kRows + r, s), r, q, sc);
    }
  });
  return {qs, scales};
}

}  // namespace kiln
