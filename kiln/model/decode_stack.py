"""Fuse each layer's q|k|v and gate|up projections into one weight each, and build the C++
`DecodeStack` (kernels/decode_stack.cpp) over them for a model served with packed weights or with the
bfloat16 tiles of the dense kernel.

`fuse_projections` (run by the loader) concatenates the projections that read one input (whole
16-row tiles stack), and the per-projection weights become views into the fused storage, no second
copy. The serving path's layers (kiln/model/transformer.py) then quantize or widen a layer's input
once per group instead of once per projection, and the stack multiplies with the same weights:
outputs are per output row, so fusing changes no value.

The stack runs all decoder layers of a step in one call when every token of it attends on the
kernels' paged attention: decodes, and prompt chunks whose queries all sit below the kernels' line
(kernels.chunk_attention_kernel_positions). It needs every layer fused and
its other projections packed (q4_1 / q8_0 / K-quants) or every one tiled (bf16), and no q/k norm (qwen3
keeps the Python path). Packed projections of one input in different formats (a Q4_K_M layer's Q4_K
q/k beside its Q6_K v) cannot fuse: the stack runs them as parts and concatenates their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kiln.model.dense_tiles import DenseTiles
from kiln.model.quant import TILE_ROWS, PackedWeight, concat_packed

if TYPE_CHECKING:
    from kiln.model.transformer import Transformer

Weight = PackedWeight | DenseTiles


@dataclass(eq=False)
class FusedProjection:
    """Projections of one input with concatenated outputs (q|k|v or gate|up) as one weight."""

    weight: Weight
    bias: torch.Tensor | None
    sizes: list[int]   # each projection's out_features, in order


def fuse_projections(model: Transformer) -> None:
    """Give every layer whose q/k/v (and gate/up) weights can stack a fused twin: `fused_qkv` on the
    attention, `fused_gate_up` on the MLP (None where they cannot). Idempotent."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "fused_qkv", None) is None:
            attn.fused_qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        if getattr(mlp, "fused_gate_up", None) is None:
            mlp.fused_gate_up = _fuse([mlp.gate_proj, mlp.up_proj])


def clear_fused(model: Transformer) -> None:
    """Forget the fused twins (before the projections' weights are replaced)."""
    for layer in model.model.layers:
        layer.self_attn.fused_qkv = None
        layer.mlp.fused_gate_up = None


def _weight_attr(linears: list[torch.nn.Linear]) -> str | None:
    for attr in ("packed", "dense_tiles"):
        if all(getattr(lin, attr, None) is not None for lin in linears):
            return attr
    return None


def build_decode_stack(model: Transformer, module: ModuleType) -> Any | None:
    """A `DecodeStack` over the model's layers, or None when some layer cannot run in it."""
    cfg = model.config
    if cfg.qk_norm:
        return None
    fuse_projections(model)
    layers = list(model.model.layers)
    attr = _weight_attr([layers[0].self_attn.o_proj]) if layers else None
    groups: list[list[SimpleNamespace]] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _group_projection(attn.fused_qkv, [attn.q_proj, attn.k_proj, attn.v_proj], attr)
        gate_up = _group_projection(mlp.fused_gate_up, [mlp.gate_proj, mlp.up_proj], attr)
        if qkv is None or gate_up is None:
            return None
        if _weight_attr([attn.o_proj, mlp.down_proj]) != attr:
            return None
        if attr == "packed" and any(not getattr(lin, attr).qs.is_cpu for lin in (attn.o_proj, mlp.down_proj)):
            return None
        groups.append([qkv, gate_up])
    stack = module.DecodeStack(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               cfg.intermediate_size, cfg.rms_norm_eps)
    for layer, (qkv, gate_up) in zip(layers, groups, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        projections = [qkv, _projection(getattr(attn.o_proj, attr), attn.o_proj.bias),
                       gate_up, _projection(getattr(mlp.down_proj, attr), mlp.down_proj.bias)]
        stack.add_layer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                        projections)
    head = _head_projection(model)
    if head is not None:
        stack.set_head(model.model.norm.weight.detach(), head)
    if attr and layers and _layer_bytes(layers[0], attr) > SPLIT_MAX_LAYER_BYTES:
        stack.min_split_rows = NO_SPLIT
    return stack


# A split step (DecodeStack.split_rows) runs each thread's share of the rows through every layer on its
# own, which saves the barrier a whole step pays at every matrix, but each part then reads every weight.
# That pays where a layer's matrices are small (SmolLM2-135M, ~2 MB a layer: 8 rows ~8% faster split on
# a 2-core Zen 4); from the sizes past the caches the doubled bytes cost more than the barriers: 2-core
# Zen 3, AVX2, Q4_K_M, decode rows at 150 positions, split / whole step time: 0.5B (8.5 MB a layer)
# 8 rows 1.29, 16 rows 1.23, 32 rows 1.13, 64 rows 0.97; 1B (34 MB) 8 rows 1.26, 16 1.15, 32 1.18, 64
# 1.27, and a 16-512-token prompt chunk 1.00-1.19. Above this many bytes a layer, steps stay whole.
SPLIT_MAX_LAYER_BYTES = 4 << 20
NO_SPLIT = 1 << 40   # DecodeStack.min_split_rows: more rows a part than any step has


def _layer_bytes(layer: torch.nn.Module, attr: str) -> int:
    """The bytes a decode row's pass over the layer's projections reads (packed blocks, or the dense
    kernel's codes where it has them, else its bfloat16 tiles)."""
    total = 0
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        w = getattr(lin, attr)
        if isinstance(w, PackedWeight):
            total += w.qs.nbytes + w.scales.nbytes
        elif isinstance(w, DenseTiles):
            total += w.codes.nbytes + w.scales.nbytes if w.coded else w.tiles.nbytes
    return total


def _group_projection(fused: FusedProjection | None, linears: list[torch.nn.Linear],
                      attr: str | None) -> SimpleNamespace | None:
    """What the stack multiplies a group of projections of one input with: their fused weight, or
    for packed weights of different kinds (a Q4_K_M layer's Q4_K q/k beside its Q6_K v) the parts
    side by side, their outputs concatenated (each output row's value is the same either way)."""
    if fused is not None:
        return _projection(fused.weight, fused.bias) if isinstance(fused.weight, PackedWeight) == (attr == "packed") \
            else None
    if attr != "packed" or _weight_attr(linears) != "packed" or any(not lin.packed.qs.is_cpu for lin in linears):
        return None
    parts = [_projection(lin.packed, lin.bias) for lin in linears]
    return SimpleNamespace(kind="parts", parts=parts, out_features=sum(p.out_features for p in parts),
                           in_features=parts[0].in_features, bias=None, float_act=False)


def _head_projection(model: Transformer) -> SimpleNamespace | None:
    """The LM head as the stack computes it, the weights `Transformer.compute_logits` multiplies with
    (packed, else the dense kernel's tiles), or None when that runs elsewhere (torch)."""
    lm_head = model.lm_head
    packed = getattr(lm_head, "packed", None)
    if packed is not None:
        return _projection(packed, None) if packed.qs.is_cpu else None
    tiles = getattr(lm_head, "dense_tiles", None)
    if tiles is None or model.dtype != torch.bfloat16:
        return None
    return _projection(tiles, lm_head.bias)


def _fuse(linears: list[torch.nn.Linear]) -> FusedProjection | None:
    """One weight for the concatenated outputs (whole tiles stack); each linear's own weight becomes a
    view of it. None when the weights cannot stack (mixed kinds, a part of partial tiles, not CPU)."""
    attr = _weight_attr(linears)
    if attr is None:
        return None
    parts: list[Weight] = [getattr(lin, attr) for lin in linears]
    if any(p.out_features % TILE_ROWS for p in parts[:-1]) or len({p.in_features for p in parts}) != 1:
        return None
    if isinstance(parts[0], PackedWeight):
        if len({p.kind for p in parts}) != 1 or len({p.float_act for p in parts}) != 1:  # type: ignore[union-attr]
            return None
        if any(not p.qs.is_cpu for p in parts):  # type: ignore[union-attr]
            return None
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
    return FusedProjection(fused, bias, [lin.out_features for lin in linears])


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
