// DecodeStack: the decoder layers of a CPU-served model (packed q4_1 / q8_0 weights, or bfloat16 tiles
// of the dense kernel) for steps whose every token attends through paged_attention: decodes, and the
// prompt tokens that attend on the kernel too (each with its own row of context slots and length).
//
// A decode step spends as long in Python's per-op overhead (about 25 small calls per layer) as in
// the matmuls; this class runs the same sequence of calls from C++ instead:
//
//   x = rms_norm(h); q, k, v = qlinear(x); rope_and_cache; o = paged_attention; h = h + qlinear(o)
//   x = rms_norm(h); gate, up = qlinear(x); h = h + qlinear(silu_mul(gate, up))
//
// It calls the very functions the Python path (kiln/model/transformer.py) calls, in the same order and
// dtypes (the same Kiln kernels for norms, adds and silu_mul), so a token computed here is bit-identical to the
// same token computed in a mixed step there: a sequence's output never depends on which path carried
// which of its steps. Projections whose outputs are concatenated (q/k/v, gate/up) may be one packed
// weight: qlinear's outputs are per output row, so fusing them changes no value.
//
// Adapters: decode rows on LoRA slots get each projection's delta from the same BGMV kernel the
// Python path calls (lora_bgmv_add), added in place to that projection's part of the fused output.

#include "decode_stack.h"

#include <ATen/ThreadLocalState.h>

#include "decode_ops.h"
#include "dense_bf16.h"
#include "lora_bgmv.h"
#include "qlinear.h"
#include "qlinear_float.h"
#include "qlinear_kquant.h"
#include "silu_mul.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <limits>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace kiln {
namespace {

// activation rows up to which coded weights multiply from their codes (kiln/model/dense_tiles.py)
constexpr int64_t kCodedMaxRows = 8;
// A step splits over the threads from this many rows a thread (DecodeStack::split_rows): gguf, 2
// threads, 150 positions, split vs whole: AVX2 8 rows 9.8 vs 10.6 ms, 4 rows 6.6 vs 6.3; AVX-512 8 rows
// 6.1 vs 6.9, 4 rows 4.8 vs 4.4. Over bfloat16 tiles (twice the bytes a part reads): AVX-512 16 rows
// 34.6 vs 33.0, 32 rows 58.2 vs 59.9; the GGUF codes with float activations (AVX2's default) split
// well from 8 rows (19.9 vs 22.3).
constexpr int64_t kMinSplitRows = 4;
constexpr int64_t kMinSplitRowsTiles = 16;
// The LM head runs in the parts (each reading all of it) from this many rows a part, else on the
// pool after them: gguf, 2 threads, in the parts vs after, AVX2 64 rows 75.6 vs 78.2 ms, 32 rows 34.8 vs
// 34.9, 8 rows 12.8 vs 11.8; AVX-512 64 rows 48.5 vs 49.0, 16 rows 12.0 vs 11.4.
constexpr int64_t kHeadSplitRows = 32;
// Each part reads every weight, so with more threads than this the step stays on the pool (where the
// threads share out each matrix): measured on 2 cores only.
constexpr int64_t kMaxSplitThreads = 4;
// one row's matrices cost about what its attention over this many positions costs (gguf, AVX2: 64
// rows over 100 vs 270 positions 72 vs 87 ms a step, about 1 ms a row besides the attention), measured
// on SmolLM2-135M, whose matrices do kRowMacsPerPositionMac times the multiply-adds of a position of
// attention a row; another model's figure scales with its own ratio (Llama-3.2-1B's is 4.8x 135M's:
// at 700 a 500-token prompt split 283 | 217 rows, its thread of 217 idle for ~12% of the step)
constexpr double kRowPositions = 700;
constexpr double kRowMacsPerPositionMac = 3072;

// How far a part of a split step has got: layers whose K/V its rows have written (and, for a part that
// continues a prompt chunk, whose earlier rows' K/V the part before it has written).
struct Progress {
  alignas(64) std::atomic<int64_t> layers{0};
};

inline void spin_pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// Projection kinds past the dense tiles': K-quant tiles (qlinear_kquant, format kind - kKQuant), and
// parts of different kinds whose outputs concatenate (a Q4_K_M layer's Q4_K q/k beside its Q6_K v)
constexpr int64_t kKQuant = 10;
// iq4_nl tiles (qlinear's kind 2: 4-bit codes through IQ4's table, 8-bit activations only)
constexpr int64_t kIq4 = 5;
constexpr int64_t kQlinearIq4 = 2;
constexpr int64_t kParts = 20;

struct Projection {
  torch::Tensor qs, scales, codes;
  int64_t kind, n, k;
  bool float_act = false;   // packed weights with float activations (qlinear_float) instead of int8
  c10::optional<torch::Tensor> bias;
  std::vector<Projection> parts;   // kind kParts: each part's outputs, concatenated in order

  // kind 0 / 1 / 5: packed q4_1 / q8_0 / iq4_nl (qs, scales); kind 2: bfloat16 tiles of the dense kernel (qs); kind 3 / 4:
  // those tiles (qs) and the same values as 4-bit / int8 codes (codes, scales) for decode rows
  // out_float: float32 sums (logits), from float32 activations for packed weights as the LM head's
  // Python path gives them (kiln/model/transformer.py's compute_logits)
  torch::Tensor operator()(const torch::Tensor& x, bool out_float = false) const {
    if (kind == kParts) {
      std::vector<torch::Tensor> ys;
      for (const auto& part : parts) ys.push_back(part(x, out_float));
      return torch::cat(ys, -1);
    }
    if ((kind == 3 || kind == 4) && x.size(0) <= kCodedMaxRows)
      return linear_bf16_coded(x, codes, scales, kind - 3, n, k, bias, -1, out_float);
    if (kind >= 2 && kind <= 4) return linear_bf16(x, qs, n, k, bias, -1, out_float);
    if (out_float) return (*this)(x.to(torch::kFloat32));
    if (kind >= kKQuant) return qlinear_kquant(x, qs, scales, kind - kKQuant, n, k, bias, -1, false, float_act);
    if (kind == kIq4) return qlinear(x, qs, scales, kQlinearIq4, n, k, bias, -1);
    if (float_act) return qlinear_float(x, qs, scales, kind, n, k, bias, -1, false);
    return qlinear(x, qs, scales, kind, n, k, bias, -1);
  }
};

struct Layer {
  torch::Tensor in_norm, post_norm;
  Projection qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(intermediate), eps_(eps) {}

  // The final norm and the LM head, for forward(logits=true).
  void set_head(torch::Tensor norm, const py::object& projection) {
    head_norm_ = std::move(norm);
    head_ = to_projection(projection);
    has_head_ = true;
  }

  bool has_head() const { return has_head_; }

  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, std::vector<py::object> projections) {
    TORCH_CHECK_VALUE(projections.size() == 4, "DecodeStack.add_layer: qkv, o, gate_up, down");
    Projection p[4];
    for (int i = 0; i < 4; ++i) p[i] = to_projection(projections[i]);
    TORCH_CHECK_VALUE(p[0].n == (heads_ + 2 * kv_heads_) * head_dim_ && p[2].n == 2 * inter_,
                      "DecodeStack.add_layer: qkv or gate_up has the wrong number of outputs");
    layers_.push_back(Layer{std::move(in_norm), std::move(post_norm), p[0], p[1], p[2], p[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // split_rows' cost of one row's matrices, in positions of its attention (0: from the layers' shapes)
  double row_positions() const {
    if (row_positions_ > 0) return row_positions_;
    if (layers_.empty()) return kRowPositions;
    const Layer& L = layers_[0];
    const double macs = static_cast<double>(L.qkv.n * L.qkv.k + L.o.n * L.o.k + L.gate_up.n * L.gate_up.k +
                                            L.down.n * L.down.k);
    const double per_position = 2.0 * static_cast<double>(heads_ * head_dim_);   // q.k and p.v
    return kRowPositions * macs / per_position / kRowMacsPerPositionMac;
  }
  void set_row_positions(double n) {
    TORCH_CHECK_VALUE(n >= 0, "DecodeStack.row_positions must not be negative");
    row_positions_ = n;
  }
  int64_t min_split_rows() const {
    if (min_split_rows_ > 0) return min_split_rows_;
    return !layers_.empty() && layers_[0].o.kind >= 2 && layers_[0].o.kind <= 4 ? kMinSplitRowsTiles : kMinSplitRows;
  }
  void set_min_split_rows(int64_t n) {
    TORCH_CHECK_VALUE(n >= 1, "DecodeStack.min_split_rows must be at least 1");
    min_split_rows_ = n;
  }

  // h [T, hidden] -> h after every layer; with out_rows (an int64 index, ascending) those rows of it;
  // with logits (set_head first) their float32 logits [rows, vocab] instead.
  // kv [layers, 2, slots, Hkv, D]; cos, sin [T, D] rows; slot_mapping [T]; context_slots [T, L] and
  // context_lens [T] as paged_attention takes them. units [U] (optional): how many consecutive rows
  // each unit holds (a prompt chunk's rows are one unit); None: every row is its own unit.
  // With lora_slots [T] (int64, 0 = base): lora_a / lora_b hold, per module in the order q, k, v, o,
  // gate, up, down, the bank's float32 factors [layers, S, R, in] / [layers, S, R, out], or None for a
  // module no adapter uses.
  //
  // Rows split over the threads: each thread runs every layer for its own contiguous rows, one kernel
  // after another on that thread alone, with no barrier between them. The threads drift apart, so one
  // thread's attention (bound by memory) overlaps another's matrices (bound by arithmetic), and the
  // step skips two pool hand-offs per op. Every op is row-wise (each kernel gives a row the same bits
  // alone or batched), so the values are the unsplit ones. The one dependency between rows: a prompt
  // chunk's queries read the K/V its earlier rows write in the same layer, so a part that starts
  // inside a chunk waits, before each layer's attention, until the part before it has written that
  // layer's K/V (never the other way round: no cycle). Measured, gguf, 2 threads, a 64-row decode step
  // over 200 positions: AVX2 89 -> 82 ms, AVX-512 55 -> 50 ms; below kMinSplitRows rows a thread the
  // weights every part reads cost more than that saves.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv,
                        const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                        const torch::Tensor& context_lens, double scale,
                        const c10::optional<torch::Tensor>& lora_slots,
                        const std::vector<c10::optional<torch::Tensor>>& lora_a,
                        const std::vector<c10::optional<torch::Tensor>>& lora_b,
                        const c10::optional<torch::Tensor>& out_rows,
                        const c10::optional<torch::Tensor>& units, bool logits) const {
    TORCH_CHECK_VALUE(kv.dim() == 5 && kv.size(0) == num_layers() && kv.size(1) == 2,
                      "DecodeStack.forward: kv must be [layers, 2, slots, Hkv, D]");
    const bool lora = lora_slots.has_value() && lora_slots->defined();
    TORCH_CHECK_VALUE(!lora || (lora_a.size() == 7 && lora_b.size() == 7),
                      "DecodeStack.forward: lora_a and lora_b need one entry per module");
    const bool select = out_rows.has_value() && out_rows->defined();
    TORCH_CHECK_VALUE(!select || (out_rows->dim() == 1 && out_rows->scalar_type() == torch::kInt64 &&
                                  out_rows->is_contiguous()),
                      "DecodeStack.forward: out_rows is an int64 index");
    TORCH_CHECK_VALUE(!logits || has_head_, "DecodeStack.forward: logits needs set_head first");
    const int64_t T = h.size(0);
    TORCH_CHECK_VALUE(!lora || (lora_slots->dim() == 1 && lora_slots->size(0) == T &&
                                lora_slots->scalar_type() == torch::kInt64 && lora_slots->is_contiguous()),
                      "DecodeStack.forward: lora_slots must be int64 [T], one slot per row");
    if (select) {   // parts find their rows by binary search
      const int64_t* o = out_rows->data_ptr<int64_t>();
      for (int64_t j = 0; j < out_rows->numel(); ++j)
        TORCH_CHECK_VALUE(o[j] >= 0 && o[j] < T && (j == 0 || o[j] > o[j - 1]),
                          "DecodeStack.forward: out_rows must be ascending rows of h");
    }
    TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == T && context_lens.scalar_type() == torch::kInt64,
                      "DecodeStack.forward: context_lens must be int64 [T]");
    const bool has_units = units.has_value() && units->defined();
    TORCH_CHECK_VALUE(!has_units || (units->dim() == 1 && units->scalar_type() == torch::kInt64 && units->is_contiguous()),
                      "DecodeStack.forward: units must be int64 row counts");
    if (has_units) {
      const int64_t* up = units->data_ptr<int64_t>();
      int64_t rows = 0;
      for (int64_t u = 0; u < units->numel(); ++u) {
        TORCH_CHECK_VALUE(up[u] > 0, "DecodeStack.forward: units must be positive row counts");
        rows += up[u];
      }
      TORCH_CHECK_VALUE(rows == T, "DecodeStack.forward: units must add up to T");
    }
    const Rows all{h.clone(at::MemoryFormat::Contiguous), cos, sin, slot_mapping, context_slots, context_lens,
                   lora ? *lora_slots : torch::Tensor(), select ? *out_rows : torch::Tensor()};
    const std::vector<int64_t> cuts = split_rows(context_lens);
    if (cuts.size() < 3) return forward_rows(all, kv, scale, lora_a, lora_b, logits);
    const size_t parts = cuts.size() - 1;
    std::vector<Rows> part(parts);
    std::vector<bool> waits(parts, false);   // the part starts inside a prompt chunk
    for (size_t g = 0; g < parts; ++g) part[g] = all.slice(cuts[g], cuts[g + 1]);
    if (has_units) {
      const int64_t* up = units->data_ptr<int64_t>();
      size_t g = 1;
      for (int64_t u = 0, row = 0; u < units->numel() && g < parts; row += up[u++])
        for (; g < parts && cuts[g] < row + up[u]; ++g) waits[g] = cuts[g] > row;
    }
    // the LM head in the parts once each has kHeadSplitRows rows to multiply, else on the pool after
    bool head_in_parts = logits;
    for (const Rows& r : part)
      head_in_parts = head_in_parts && (r.out_rows.defined() ? r.out_rows.numel() : r.h.size(0)) >= kHeadSplitRows;
    std::vector<Progress> progress(parts);
    std::vector<torch::Tensor> outs(parts);
    std::vector<std::exception_ptr> errors(parts);   // raised here, not on a pool thread
    // the caller's grad / inference mode and dispatch state on every part's thread (as at::launch does)
    const at::ThreadLocalState caller;
    kiln::parallel_tasks(static_cast<int64_t>(parts), [&](int64_t i) {
      const auto g = static_cast<size_t>(i);
      const Rows& r = part[g];
      const at::ThreadLocalStateGuard state(caller);
      try {
        outs[g] = forward_rows(r, kv, scale, lora_a, lora_b, head_in_parts, &progress[g],
                               waits[g] ? &progress[g - 1] : nullptr);
      } catch (...) {
        errors[g] = std::current_exception();
        progress[g].layers.store(std::numeric_limits<int64_t>::max(), std::memory_order_release);   // unblock
      }
    });
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
    return logits && !head_in_parts ? head_logits(torch::cat(outs, 0)) : torch::cat(outs, 0);
  }

 private:
  // One contiguous run of a step's rows and what each row carries; out_rows (undefined: all) index it.
  struct Rows {
    torch::Tensor h, cos, sin, slot_mapping, context_slots, context_lens, lora_slots, out_rows;

    Rows slice(int64_t a, int64_t b) const {
      Rows r{h.narrow(0, a, b - a), cos.narrow(0, a, b - a), sin.narrow(0, a, b - a), slot_mapping.narrow(0, a, b - a),
             context_slots.narrow(0, a, b - a), context_lens.narrow(0, a, b - a),
             lora_slots.defined() ? lora_slots.narrow(0, a, b - a) : torch::Tensor(), torch::Tensor()};
      if (out_rows.defined()) {
        const int64_t* o = out_rows.data_ptr<int64_t>();
        const int64_t n = out_rows.numel();
        const int64_t lo = std::lower_bound(o, o + n, a) - o, hi = std::lower_bound(o, o + n, b) - o;
        r.out_rows = out_rows.narrow(0, lo, hi - lo) - a;
      }
      return r;
    }
  };

  // Where to cut the rows, one part per thread ({}: do not split): at even shares of the cost, each
  // row costing its matrices (kRowPositions positions of attention's worth) plus its attention (its
  // context length). No split below min_split_rows() rows a part.
  std::vector<int64_t> split_rows(const torch::Tensor& context_lens) const {
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t T = context_lens.size(0);
    if (threads < 2 || threads > kMaxSplitThreads || T < threads * min_split_rows()) return {};
    const auto lens = context_lens.contiguous();
    const int64_t* lp = lens.data_ptr<int64_t>();
    std::vector<double> cost(static_cast<size_t>(T));   // of rows 0..r inclusive
    const double row = row_positions();
    double total = 0;
    for (int64_t r = 0; r < T; ++r) cost[static_cast<size_t>(r)] = total += row + static_cast<double>(lp[r]);
    std::vector<int64_t> cuts{0};
    for (int64_t g = 1; g < threads; ++g) {
      const double share = total * static_cast<double>(g) / static_cast<double>(threads);
      const int64_t cut = (std::lower_bound(cost.begin(), cost.end(), share) - cost.begin()) + 1;
      if (cut - cuts.back() < min_split_rows()) return {};
      cuts.push_back(cut);
    }
    if (T - cuts.back() < min_split_rows()) return {};
    cuts.push_back(T);
    return cuts;
  }

  // Every layer for `rows`. In a split step `own` counts the layers whose K/V this part has written,
  // after `before` (the part before it, when this one starts inside a prompt chunk) has written them.
  torch::Tensor forward_rows(const Rows& rows, const torch::Tensor& kv, double scale,
                             const std::vector<c10::optional<torch::Tensor>>& lora_a,
                             const std::vector<c10::optional<torch::Tensor>>& lora_b, bool logits,
                             Progress* own = nullptr, const Progress* before = nullptr) const {
    torch::Tensor h = rows.h;
    const torch::Tensor &cos = rows.cos, &sin = rows.sin, &slot_mapping = rows.slot_mapping;
    const torch::Tensor &context_slots = rows.context_slots, &context_lens = rows.context_lens;
    const bool lora = rows.lora_slots.defined(), select = rows.out_rows.defined();
    const bool cache_only = select && rows.out_rows.numel() == 0;   // none of its rows asked for: K/V only
    torch::Tensor lora_slots = rows.lora_slots;   // the last layer's rows only, once it selects them
    const int64_t T = h.size(0);
    const int64_t qn = heads_ * head_dim_, kn = kv_heads_ * head_dim_;
    // out[:, :] += x @ A[slot]^T @ B[slot] for module m of layer i, when some adapter uses it
    auto add_lora = [&](int m, int64_t i, torch::Tensor out, const torch::Tensor& x) {
      if (!lora || !lora_a[m].has_value() || !lora_a[m]->defined()) return;
      lora_bgmv_add(std::move(out), x, lora_a[m]->select(0, i), lora_b[m]->select(0, i), lora_slots, -1);
    };
    // At one token per sequence a step's dozen small ops per layer cost as much as a matrix does, so
    // the residual adds happen in place (on forward's copy of the caller's h) and q, k, v stay views of
    // the fused output; every value is rounded as the layer path rounds it.
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& L = layers_[static_cast<size_t>(i)];
      auto k_cache = kv.select(0, i).select(0, 0);
      auto v_cache = kv.select(0, i).select(0, 1);
      auto x = rms_norm(h, L.in_norm, eps_);
      auto qkv = L.qkv(x);
      if (lora) {
        add_lora(0, i, qkv.narrow(1, 0, qn), x);
        add_lora(1, i, qkv.narrow(1, qn, kn), x);
        add_lora(2, i, qkv.narrow(1, qn + kn, kn), x);
      }
      auto q = qkv.narrow(1, 0, qn).view({T, heads_, head_dim_});
      auto k = qkv.narrow(1, qn, kn).view({T, kv_heads_, head_dim_});
      auto v = qkv.narrow(1, qn + kn, kn).view({T, kv_heads_, head_dim_});
      rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
      if (before != nullptr) {
        for (int spins = 0; before->layers.load(std::memory_order_acquire) <= i; ++spins) {
          if (spins < 4096) {
            spin_pause();
          } else {
            std::this_thread::yield();
          }
        }
      }
      if (own != nullptr) own->layers.store(i + 1, std::memory_order_release);
      if (cache_only && i == num_layers() - 1) {
        return logits ? torch::empty({0, head_.n}, h.options().dtype(torch::kFloat32)) : h.narrow(0, 0, 0);
      }
      torch::Tensor attn;
      if (select && i == num_layers() - 1) {
        // every token's K/V is in the cache; the rest of the last layer runs for the rows asked for
        // (row-wise ops all, so each gets the values the whole batch would give it)
        h = h.index_select(0, rows.out_rows);
        if (lora) lora_slots = lora_slots.index_select(0, rows.out_rows);
        attn = paged_attention(q.index_select(0, rows.out_rows), k_cache, v_cache,
                               context_slots.index_select(0, rows.out_rows), context_lens.index_select(0, rows.out_rows), scale);
      } else {
        attn = paged_attention(q, k_cache, v_cache, context_slots, context_lens, scale);
      }
      auto o = L.o(attn);
      add_lora(3, i, o, attn);
      add_inplace(h, o);
      auto x2 = rms_norm(h, L.post_norm, eps_);
      auto gu = L.gate_up(x2);
      if (lora) {
        add_lora(4, i, gu.narrow(1, 0, inter_), x2);
        add_lora(5, i, gu.narrow(1, inter_, inter_), x2);
      }
      auto act = silu_mul(gu);
      auto d = L.down(act);
      add_lora(6, i, d, act);
      add_inplace(h, d);
    }
    return logits ? head_logits(h) : h;
  }

  torch::Tensor head_logits(const torch::Tensor& h) const { return head_(rms_norm(h, head_norm_, eps_), /*out_float=*/true); }

  // silu(gate) * up from the fused gate|up output: Kiln's kernel, which the layer path's MLP calls too
  // (an element's bits do not depend on where in a row it sits; ATen's silu tails did)
  at::Tensor silu_mul(const at::Tensor& gu) const {
    return kiln::silu_mul(gu.narrow(1, 0, inter_), gu.narrow(1, inter_, inter_));
  }

  static Projection to_projection(const py::object& packed) {
    // kiln/model/decode_stack.py's projection: qs, scales, kind, out_features, in_features, bias
    Projection p;
    const auto kind = packed.attr("kind").cast<std::string>();
    p.n = packed.attr("out_features").cast<int64_t>();
    p.k = packed.attr("in_features").cast<int64_t>();
    if (kind == "parts") {
      p.kind = kParts;
      for (const auto& part : packed.attr("parts").cast<std::vector<py::object>>()) p.parts.push_back(to_projection(part));
      return p;
    }
    p.qs = packed.attr("qs").cast<torch::Tensor>();
    TORCH_CHECK_VALUE(kind == "q4_1" || kind == "q8_0" || kind == "bf16" || kind == "bf16_codes0" || kind == "bf16_codes1" ||
                          kind == "q4_k" || kind == "q5_k" || kind == "q6_k" || kind == "iq4_nl",
                      "DecodeStack: unknown weight kind ", kind);
    p.kind = kind == "q4_1" ? 0 : kind == "q8_0" ? 1 : kind == "bf16" ? 2 : kind == "bf16_codes0" ? 3
           : kind == "bf16_codes1" ? 4 : kind == "iq4_nl" ? kIq4 : kind == "q4_k" ? kKQuant
           : kind == "q5_k" ? kKQuant + 1 : kKQuant + 2;
    if (p.kind != 2) p.scales = packed.attr("scales").cast<torch::Tensor>();
    if (p.kind == 3 || p.kind == 4) p.codes = packed.attr("codes").cast<torch::Tensor>();
    p.float_act = py::hasattr(packed, "float_act") && packed.attr("float_act").cast<bool>();
    py::object bias = packed.attr("bias");
    if (!bias.is_none()) p.bias = bias.cast<torch::Tensor>();
    return p;
  }

  int64_t heads_, kv_heads_, head_dim_, inter_;
  int64_t min_split_rows_ = 0;   // 0: by the weights' kind
  double row_positions_ = 0;     // 0: from the layers' shapes
  torch::Tensor head_norm_;
  Projection head_;
  bool has_head_ = false;
  double eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_stack(pybind11::module& m) {
  py::class_<DecodeStack>(m, "DecodeStack", "the decoder layers of a packed or bf16-tiled model, for steps that attend on the kernel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("projections"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("set_head", &DecodeStack::set_head, py::arg("norm"), py::arg("projection"))
      .def_property_readonly("has_head", &DecodeStack::has_head)
      .def_property("min_split_rows", &DecodeStack::min_split_rows, &DecodeStack::set_min_split_rows,
                    "a step splits its rows over the threads from this many rows a thread")
      .def_property("row_positions", &DecodeStack::row_positions, &DecodeStack::set_row_positions,
                    "a row's matrices cost, in positions of its attention, when a step splits its rows")
      .def("forward", &DecodeStack::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("slot_mapping"), py::arg("context_slots"), py::arg("context_lens"), py::arg("scale"),
           py::arg("lora_slots") = py::none(), py::arg("lora_a") = std::vector<c10::optional<torch::Tensor>>(),
           py::arg("lora_b") = std::vector<c10::optional<torch::Tensor>>(), py::arg("out_rows") = py::none(),
           py::arg("units") = py::none(), py::arg("logits") = false,
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace kiln
