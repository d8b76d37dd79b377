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
        fuse = _fuse if attr == "packed" else _fuse_tiles
        own = _projection if attr == "packed" else _tiles_projection
        projections = [fuse(qkv), own(getattr(o_proj, attr), o_proj.bias), fuse(gate_up),
                       own(getattr(down_proj, attr), down_proj.bias)]
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
    return _projection(fused, _fused_bias(linears))


def _fuse_tiles(linears: list[torch.nn.Linear]) -> SimpleNamespace:
    """`_fuse` for the dense kernel's bfloat16 tiles."""
    parts: list[DenseTiles] = [lin.dense_tiles for lin in linears]  # type: ignore[misc]
    fused = torch.cat([p.tiles for p in parts])
    tile = 0
    for lin, part in zip(linears, parts, strict=True):
        tiles = part.tiles.shape[0]
        lin.dense_tiles = DenseTiles(fused[tile:tile + tiles], part.out_features, part.in_features)
        tile += tiles
    return _tiles_projection(DenseTiles(fused, sum(p.out_features for p in parts), parts[0].in_features),
                             _fused_bias(linears))


def _tiles_projection(tiles: DenseTiles, bias: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(qs=tiles.tiles, kind="bf16", out_features=tiles.out_features,
                           in_features=tiles.in_features, bias=None if bias is None else bias.detach())


def _fused_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                      for b, lin in zip(biases, linears, strict=True)])


def _projection(packed: PackedWeight, bias: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(qs=packed.qs, scales=packed.scales, kind=packed.kind, out_features=packed.out_features,
                           in_features=packed.in_features, bias=None if bias is None else bias.detach())
