// The K-quant tiles' codec, load side: GGUF blocks into tiles (kquant_dequant.cpp turns tiles back into
// dense weights for the torch paths).
//
// Load: each row's superblock is rewritten as its row record (kiln/model/kquant.py's `_records`, documented there) and 16 rows' records are scattered into a
// tile by the byte permutation kquant.py computes (`_permutation`, passed in), codes into qs and the
// rest into scales. The numpy path it replaces took ~20 s of a 1B Q4_K_M model's load on two cores; this
// is one pass over the file's bytes, the tiles shared out on the kernels' pool.

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

}  // namespace

namespace kiln {

std::vector<torch::Tensor> kquant_tiles_from_gguf(const torch::Tensor& blocks, int64_t fmt, int64_t n, int64_t k,
                                                  const c10::optional<torch::Tensor>& rows, const torch::Tensor& perm,
                                                  int64_t super_bytes) {
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
  auto opts = blocks.options();
  auto qs = torch::empty({T, S, super_bytes}, opts), scales = torch::empty({T, S, SB}, opts);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t* pm = perm.data_ptr<int64_t>();
  uint8_t* qd = qs.data_ptr<uint8_t>();
  uint8_t* sd = scales.data_ptr<uint8_t>();
  parallel_tasks(T, [&](int64_t t) {
    std::vector<uint8_t> recs(static_cast<size_t>(tb));
    for (int64_t s = 0; s < S; ++s) {
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = t * kRows + r;
        if (row >= n) {
          std::memset(recs.data() + r * rb, 0, static_cast<size_t>(rb));   // d = 0: a zero row
          continue;
        }
        const int64_t from = idx ? idx[row] : row;
        record(f, src + (from * S + s) * rb, recs.data() + r * rb);
      }
      uint8_t* q = qd + (t * S + s) * super_bytes;
      uint8_t* sc = sd + (t * S + s) * SB;
      for (int64_t i = 0; i < super_bytes; ++i) q[i] = recs[pm[i]];
      for (int64_t i = 0; i < SB; ++i) sc[i] = recs[pm[super_bytes + i]];
    }
  });
  return {qs, scales};
}

}  // namespace kiln
