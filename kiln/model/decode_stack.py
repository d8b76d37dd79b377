"""Build the C++ `DecodeStack` (kernels/decode_stack.cpp) for a model served with packed weights.

The stack runs all decoder layers of a decode-only step in one call. It needs every projection of
every layer packed (q4_1 / q8_0), no q/k norm (qwen3 keeps the Python path), and whole 16-row tiles
for q/k and gate, so the concatenated q|k|v and gate|up weights are the layers' own storage: the
per-projection `packed` weights become views into them and the model holds no second copy.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kiln.model.quant import TILE_ROWS, PackedWeight, concat_packed

if TYPE_CHECKING:
    from kiln.model.transformer import Transformer


def build_decode_stack(model: Transformer, module: ModuleType) -> Any | None:
    """A `DecodeStack` over the model's layers, or None when some layer cannot run in it."""
    cfg = model.config
    if cfg.qk_norm:
        return None
    layers = list(model.model.layers)
    plans = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        linears = [*qkv, attn.o_proj, *gate_up, mlp.down_proj]
        packed = [getattr(lin, "packed", None) for lin in linears]
        if any(p is None or not p.qs.is_cpu for p in packed):
            return None
        for group in (packed[:3], packed[4:6]):
            if len({p.kind for p in group}) != 1 or any(p.out_features % TILE_ROWS for p in group[:-1]):
                return None
        plans.append((qkv, gate_up, attn.o_proj, mlp.down_proj))
    stack = module.DecodeStack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.rms_norm_eps)
    for layer, (qkv, gate_up, o_proj, down_proj) in zip(layers, plans, strict=True):
        projections = [_fuse(qkv), _projection(o_proj.packed, o_proj.bias), _fuse(gate_up),
                       _projection(down_proj.packed, down_proj.bias)]
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        projections)
    return stack


def _fuse(linears: list[torch.nn.Linear]) -> SimpleNamespace:
    """One packed weight for the concatenated outputs; each linear's `packed` becomes a view of it."""
    parts: list[PackedWeight] = [lin.packed for lin in linears]  # type: ignore[misc]
    fused = concat_packed(parts)
    tile = 0
    for lin, part in zip(linears, parts, strict=True):
        tiles = part.qs.shape[0]
        lin.packed = PackedWeight(part.kind, part.out_features, part.in_features,
                                  fused.qs[tile:tile + tiles], fused.scales[tile:tile + tiles])
        tile += tiles
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                          for b, lin in zip(biases, linears, strict=True)])
    return _projection(fused, bias)


def _projection(packed: PackedWeight, bias: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(qs=packed.qs, scales=packed.scales, kind=packed.kind, out_features=packed.out_features,
                           in_features=packed.in_features, bias=None if bias is None else bias.detach())
