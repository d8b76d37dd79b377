"""Build the C++ `DecodeStack` (kernels/decode_stack.cpp) for a model served with packed weights or
with the bfloat16 tiles of the dense kernel.

The stack runs all decoder layers of a decode-only step in one call. It needs every projection of
every layer packed (q4_1 / q8_0) or every one tiled (bf16), no q/k norm (qwen3 keeps the Python
path), and whole 16-row tiles for q/k and gate, so the concatenated q|k|v and gate|up weights are the
layers' own storage: the per-projection weights become views into them, no second copy.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kiln.model.dense_tiles import DenseTiles
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
    attr = None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        linears = [*qkv, attn.o_proj, *gate_up, mlp.down_proj]
        attr = attr or ("packed" if getattr(attn.q_proj, "packed", None) is not None else "dense_tiles")
        weights = [getattr(lin, attr, None) for lin in linears]
        if any(w is None for w in weights):
            return None
        if attr == "packed":
            if any(not w.qs.is_cpu for w in weights):
                return None
            if any(len({w.kind for w in group}) != 1 for group in (weights[:3], weights[4:6])):
                return None
        if any(w.out_features % TILE_ROWS for w in (*weights[:2], weights[4])):
            return None
        plans.append((qkv, gate_up, attn.o_proj, mlp.down_proj))
    stack = module.DecodeStack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.rms_norm_eps)
    for layer, (qkv, gate_up, o_proj, down_proj) in zip(layers, plans, strict=True):
        projections = [_fuse(qkv, attr), _projection(getattr(o_proj, attr), o_proj.bias), _fuse(gate_up, attr),
                       _projection(getattr(down_proj, attr), down_proj.bias)]
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        projections)
    return stack


Weight = PackedWeight | DenseTiles


def _fuse(linears: list[torch.nn.Linear], attr: str) -> SimpleNamespace:
    """One weight for the concatenated outputs (whole tiles stack); each linear's own weight (`attr`)
    becomes a view of it."""
    parts: list[Weight] = [getattr(lin, attr) for lin in linears]
    if isinstance(parts[0], PackedWeight):
        fused: Weight = concat_packed(parts)  # type: ignore[arg-type]
    else:
        tiles = torch.cat([p.tiles for p in parts])  # type: ignore[union-attr]
        n, k = sum(p.out_features for p in parts), parts[0].in_features
        if all(p.coded for p in parts) and len({p.code_kind for p in parts}) == 1:  # type: ignore[union-attr]
            fused = DenseTiles(tiles, n, k, torch.cat([p.codes for p in parts]),  # type: ignore[union-attr]
                               torch.cat([p.scales for p in parts]), parts[0].code_kind)  # type: ignore[union-attr]
        else:  # blocks of different kinds: the tiles alone
            fused = DenseTiles(tiles, n, k)
    tile = 0
    for lin, part in zip(linears, parts, strict=True):
        n = _tensors(part)[0].shape[0]
        views = [t[tile:tile + n] for t in _tensors(fused)]
        if isinstance(part, PackedWeight):
            setattr(lin, attr, PackedWeight(part.kind, part.out_features, part.in_features, *views, part.float_act))
        else:
            setattr(lin, attr, DenseTiles(views[0], part.out_features, part.in_features,
                                          *(views[1:] + [fused.code_kind] if fused.coded else [])))  # type: ignore
        tile += n
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                          for b, lin in zip(biases, linears, strict=True)])
    return _projection(fused, bias)


def _tensors(w: Weight) -> list[torch.Tensor]:
    """The per-tile storage of a weight (tiles along dim 0)."""
    if isinstance(w, PackedWeight):
        return [w.qs, w.scales]
    return [w.tiles, w.codes, w.scales] if w.coded else [w.tiles]


def _projection(w: Weight, bias: torch.Tensor | None) -> SimpleNamespace:
    """What DecodeStack.add_layer reads: qs, scales (packed only), kind, out_features, in_features, bias."""
    bias = None if bias is None else bias.detach()
    if isinstance(w, PackedWeight):
        return SimpleNamespace(qs=w.qs, scales=w.scales, kind=w.kind, out_features=w.out_features,
                               in_features=w.in_features, bias=bias, float_act=w.float_act)
    if w.coded:
        return SimpleNamespace(qs=w.tiles, codes=w.codes, scales=w.scales, kind=f"bf16_codes{w.code_kind}",
                               out_features=w.out_features, in_features=w.in_features, bias=bias, float_act=False)
    return SimpleNamespace(qs=w.tiles, kind="bf16", out_features=w.out_features, in_features=w.in_features,
                           bias=bias, float_act=False)
