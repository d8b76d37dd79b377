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

#include "decode_ops.h"
#include "dense_bf16.h"
#include "lora_bgmv.h"
#include "qlinear.h"
#include "qlinear_float.h"
#include "silu_mul.h"

#include <algorithm>
#include <vector>

namespace kiln {
namespace {

// activation rows up to which coded weights multiply from their codes (kiln/model/dense_tiles.py)
constexpr int64_t kCodedMaxRows = 8;

struct Projection {
  torch::Tensor qs, scales, codes;
  int64_t kind, n, k;
  bool float_act = false;   // packed weights with float activations (qlinear_float) instead of int8
  c10::optional<torch::Tensor> bias;

  // kind 0 / 1: packed q4_1 / q8_0 (qs, scales); kind 2: bfloat16 tiles of the dense kernel (qs); kind 3 / 4:
  // those tiles (qs) and the same values as 4-bit / int8 codes (codes, scales) for decode rows
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind >= 3 && x.size(0) <= kCodedMaxRows) return linear_bf16_coded(x, codes, scales, kind - 3, n, k, bias, -1, false);
    if (kind >= 2) return linear_bf16(x, qs, n, k, bias, -1, false);
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

  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, std::vector<py::object> projections) {
    TORCH_CHECK_VALUE(projections.size() == 4, "DecodeStack.add_layer: qkv, o, gate_up, down");
    Projection p[4];
    for (int i = 0; i < 4; ++i) p[i] = to_projection(projections[i]);
    TORCH_CHECK_VALUE(p[0].n == (heads_ + 2 * kv_heads_) * head_dim_ && p[2].n == 2 * inter_,
                      "DecodeStack.add_layer: qkv or gate_up has the wrong number of outputs");
    layers_.push_back(Layer{std::move(in_norm), std::move(post_norm), p[0], p[1], p[2], p[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // h [T, hidden] -> h after every layer; with out_rows (an int64 index) those rows of it. kv [layers,
  // 2, slots, Hkv, D]; cos, sin [T, D] rows; slot_mapping [T]; context_slots [T, L] and context_lens [T]
  // as paged_attention takes them.
  // With lora_slots [T] (int64, 0 = base): lora_a / lora_b hold, per module in the order q, k, v, o,
  // gate, up, down, the bank's float32 factors [layers, S, R, in] / [layers, S, R, out], or None for a
  // module no adapter uses.
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv,
                        const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                        const torch::Tensor& context_lens, double scale,
                        const c10::optional<torch::Tensor>& lora_slots,
                        const std::vector<c10::optional<torch::Tensor>>& lora_a,
                        const std::vector<c10::optional<torch::Tensor>>& lora_b,
                        const c10::optional<torch::Tensor>& out_rows) const {
    TORCH_CHECK_VALUE(kv.dim() == 5 && kv.size(0) == num_layers() && kv.size(1) == 2,
                      "DecodeStack.forward: kv must be [layers, 2, slots, Hkv, D]");
    const bool lora = lora_slots.has_value() && lora_slots->defined();
    TORCH_CHECK_VALUE(!lora || (lora_a.size() == 7 && lora_b.size() == 7),
                      "DecodeStack.forward: lora_a and lora_b need one entry per module");
    const bool select = out_rows.has_value() && out_rows->defined();
    TORCH_CHECK_VALUE(!select || (!lora && out_rows->dim() == 1 && out_rows->scalar_type() == torch::kInt64),
                      "DecodeStack.forward: out_rows is an int64 index, and not for steps with adapters");
    const int64_t T = h.size(0);
    const int64_t qn = heads_ * head_dim_, kn = kv_heads_ * head_dim_;
    // out[:, :] += x @ A[slot]^T @ B[slot] for module m of layer i, when some adapter uses it
    auto add_lora = [&](int m, int64_t i, torch::Tensor out, const torch::Tensor& x) {
      if (!lora || !lora_a[m].has_value() || !lora_a[m]->defined()) return;
      lora_bgmv_add(std::move(out), x, lora_a[m]->select(0, i), lora_b[m]->select(0, i), *lora_slots, -1);
    };
    // At one token per sequence a step's dozen small ops per layer cost as much as a matrix does, so
    // the residual adds happen in place (on a copy of the caller's h) and q, k, v stay views of the
    // fused output; every value is rounded as the layer path rounds it.
    h = h.clone(at::MemoryFormat::Contiguous);
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
      torch::Tensor attn;
      if (select && i == num_layers() - 1) {
        // every token's K/V is in the cache; the rest of the last layer runs for the rows asked for
        // (row-wise ops all, so each gets the values the whole batch would give it)
        h = h.index_select(0, *out_rows);
        attn = paged_attention(q.index_select(0, *out_rows), k_cache, v_cache,
                               context_slots.index_select(0, *out_rows), context_lens.index_select(0, *out_rows), scale);
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
    return h;
  }

 private:
  // silu(gate) * up from the fused gate|up output: Kiln's kernel, which the layer path's MLP calls too
  // (an element's bits do not depend on where in a row it sits; ATen's silu tails did)
  at::Tensor silu_mul(const at::Tensor& gu) const {
    return kiln::silu_mul(gu.narrow(1, 0, inter_), gu.narrow(1, inter_, inter_));
  }

  static Projection to_projection(const py::object& packed) {
    // kiln/model/decode_stack.py's projection: qs, scales, kind, out_features, in_features, bias
    Projection p;
    p.qs = packed.attr("qs").cast<torch::Tensor>();
    const auto kind = packed.attr("kind").cast<std::string>();
    TORCH_CHECK_VALUE(kind == "q4_1" || kind == "q8_0" || kind == "bf16" || kind == "bf16_codes0" || kind == "bf16_codes1",
                      "DecodeStack: unknown weight kind ", kind);
    p.kind = kind == "q4_1" ? 0 : kind == "q8_0" ? 1 : kind == "bf16" ? 2 : kind == "bf16_codes0" ? 3 : 4;
    if (p.kind != 2) p.scales = packed.attr("scales").cast<torch::Tensor>();
    if (p.kind >= 3) p.codes = packed.attr("codes").cast<torch::Tensor>();
    p.float_act = py::hasattr(packed, "float_act") && packed.attr("float_act").cast<bool>();
    p.n = packed.attr("out_features").cast<int64_t>();
    p.k = packed.attr("in_features").cast<int64_t>();
    py::object bias = packed.attr("bias");
    if (!bias.is_none()) p.bias = bias.cast<torch::Tensor>();
    return p;
  }

  int64_t heads_, kv_heads_, head_dim_, inter_;
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
      .def("forward", &DecodeStack::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("slot_mapping"), py::arg("context_slots"), py::arg("context_lens"), py::arg("scale"),
           py::arg("lora_slots") = py::none(), py::arg("lora_a") = std::vector<c10::optional<torch::Tensor>>(),
           py::arg("lora_b") = std::vector<c10::optional<torch::Tensor>>(), py::arg("out_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace kiln
