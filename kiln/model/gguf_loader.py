"""GGUF files: metadata as plain Python values, tensors dequantized and renamed to HF names."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import Tensor

from kiln.model import kquant
from kiln.model.config import ModelConfig, UnsupportedModelError
from kiln.model.gguf_file import GGUFTensor, read_gguf
from kiln.model.heap import huge_paged, trim_heap
from kiln.model.quant import (
    TILE_ROWS,
    PackedWeight,
    blocks_placeholder,
    pack_iq4_nl_from_gguf,
    pack_iq4_xs_from_gguf,
    pack_q4_0_from_gguf,
    pack_q4_1_from_gguf,
    pack_q5_0_from_gguf,
    pack_q8_0_from_gguf,
)

Q = GGMLQuantizationType
# Q5_0 / Q5_1: llama-quantize's fallback for a Q4_K / Q5_K tensor whose rows are not whole superblocks of
# 256 (every K=576 projection of SmolLM2-135M's Q4_K_M / Q5_K_M, every K=896 one of Qwen2.5-0.5B's): Q5_0's
# blocks serve as q8_0 tiles of their values (kiln.model.quant, exact); Q5_1's are dequantized at load and
# served dense.
# IQ4_NL / IQ4_XS (4-bit codes through a fixed non-linear table; IQ4_XS falls back to IQ4_NL where K is
# not whole superblocks): served from their codes as iq4_nl tiles (kiln.model.quant: IQ4_NL exactly, IQ4_XS
# with each group's scale in float16); the startup log's "weights served" line says so per type
SUPPORTED_QUANTS = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
                    Q.IQ4_NL, Q.IQ4_XS)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a llama/qwen2/qwen3 decoder")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's `LlamaModel.permute` (rows reordered for interleaved rotary) so the
    rotate-half rotary of HF checkpoints applies. Works for weights `[out, in]` and biases `[out]`."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


class LoadCancelled(Exception):
    """The load was asked to stop (`cancel` set) before it finished."""


def check_cancel(cancel: threading.Event | None) -> None:
    """Raise LoadCancelled when `cancel` is set: loaders call it between tensors, so a load stops within
    one tensor's work (a process must not exit while a loading thread runs C++ with the GIL released:
    taking the GIL back during interpreter shutdown aborts the process)."""
    if cancel is not None and cancel.is_set():
        raise LoadCancelled()


def load_gguf(path: str, dtype: torch.dtype, packed: dict[str, Any] | None = None,
              types: dict[str, str] | None = None, kquants: bool = True, blocks_only: bool = False,
              cancel: threading.Event | None = None, on_metadata: Callable[[dict[str, Any]], None] | None = None,
              ) -> tuple[ModelConfig, dict[str, Tensor], dict[str, Any]]:
    """(config, HF-named tensors in `dtype`, metadata) for the GGUF file at `path`.

    With `packed` (a dict to fill), 2-D projection weights stored as Q4_0 / Q4_1 / Q8_0 are also
    repacked bit-exactly for the quantized kernels (kiln.model.quant), and Q4_K / Q5_K / Q6_K ones
    (whole superblocks of 256 along K) keep their blocks as tiles (kiln.model.kquant), under their
    HF names (K-quants only with `kquants`, as IQ4_NL / IQ4_XS ones, which become iq4_nl tiles; Q5_0 ones
    become q8_0 tiles of their values). With `blocks_only`, a tensor so packed is not dequantized
    at all: its entry in the returned tensors is a `blocks_placeholder` of its shape, holding no memory
    (the blocks, read from the file's mapping, are the only copy). With `types` (a dict to fill): each
    HF-named tensor's GGUF type ("Q4_K", "F32", ...). `cancel`: checked between tensors (`check_cancel`).
    `on_metadata(metadata)`: called once the key/values are read, before the tensors (the engine builds
    the tokenizer from them meanwhile)."""
    gguf = read_gguf(path)
    metadata = gguf.metadata
    if on_metadata is not None:
        on_metadata(metadata)
    config = ModelConfig.from_gguf_metadata(metadata, tensor_names=[t.name for t in gguf.tensors])
    unsupported = sorted({t.qtype.name for t in gguf.tensors if t.qtype not in SUPPORTED_QUANTS})
    if unsupported:
        raise UnsupportedModelError(
            f"{path}: tensor types {', '.join(unsupported)} are not supported; supported: "
            f"{', '.join(q.name for q in SUPPORTED_QUANTS)}"
        )
    tensors: dict[str, Tensor] = {}
    slots = fused_slots(gguf.tensors) if packed is not None and kquants else {}
    for t in gguf.tensors:
        check_cancel(cancel)
        try:
            config = _load_tensor(t, config, tensors, dtype, packed, types, kquants, blocks_only, slots.get(t.name))
        finally:
            # every use above copied the tensor out of the file (packed blocks, a dequantized or owned
            # copy): its mapped pages need not stay resident while the rest of the file loads, nor the
            # heap pages its freed temporaries leave (torch's packers and dequantization make them; the
            # K-quant packer writes its tiles in one pass, so trimming there would only re-fault pages)
            gguf.release(t)
            if t.qtype not in _K_KINDS:
                trim_heap()
    return config, tensors, metadata


# the projections of one input that the serving path fuses (kiln/model/decode_stack.py), in its order
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def fused_slots(tensors: list[GGUFTensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """For each K-quant projection that `fuse_projections` will stack with the others of its group (a
    layer's q|k|v or gate|up: one K-quant type, K whole superblocks, every part but the last whole tiles
    of 16 rows): the slices of one buffer per group (codes, scales) it is packed into, consecutive in
    the group's order. The fused weight is then a view of those buffers (`quant.joined_view`) instead of
    a copy made after the load: at 1B Q4_K_M, ~300 MB less copied and faulted in."""
    by_name = {t.name: t for t in tensors}
    slots: dict[str, tuple[Tensor, Tensor]] = {}
    for t in tensors:
        m = _BLOCK_RE.match(t.name)
        if m is None or m.group(3) != "weight":
            continue
        for group in FUSED_GROUPS:
            if m.group(2) != group[0]:
                continue
            parts = [by_name.get(f"blk.{m.group(1)}.{g}.weight") for g in group]
            if any(p is None for p in parts):
                continue
            kinds = {_K_KINDS.get(p.qtype) for p in parts}  # type: ignore[union-attr]
            k = {p.shape[-1] for p in parts}  # type: ignore[union-attr]
            if (len(kinds) != 1 or None in kinds or len(k) != 1 or any(len(p.shape) != 2 for p in parts)  # type: ignore[union-attr]
                    or k.pop() % kquant.SUPER or any(p.shape[0] % TILE_ROWS for p in parts[:-1])):  # type: ignore[union-attr]
                continue
            kind = kinds.pop()
            shapes = [kquant.tile_shapes(kind, *p.shape) for p in parts]  # type: ignore[union-attr, arg-type]
            tiles = sum(q[0] for q, _ in shapes)
            (_, sb, qw), (_, _, sw) = shapes[0]
            qs = huge_paged((tiles, sb, qw), torch.uint8)
            scales = huge_paged((tiles, sb, sw), torch.uint8)
            start = 0
            for p, (q, _) in zip(parts, shapes, strict=True):
                slots[p.name] = (qs[start:start + q[0]], scales[start:start + q[0]])  # type: ignore[union-attr]
                start += q[0]
    return slots


def _load_tensor(t: GGUFTensor, config: ModelConfig, tensors: dict[str, Tensor], dtype: torch.dtype,
                 packed: dict[str, Any] | None, types: dict[str, str] | None, kquants: bool, blocks_only: bool,
                 slot: tuple[Tensor, Tensor] | None = None) -> ModelConfig:
    """Put GGUF tensor `t` into `tensors` (and `packed`, `types`) as `load_gguf` documents; returns the
    config (rope_freqs changes its rope scaling)."""
    if t.name == "rope_freqs.weight":
        # llama.cpp's encoding of llama3 rope scaling: per-frequency divisors
        scaling = {"rope_type": "freq_factors", "factors": dequantize_tensor(t).float().tolist()}
        return dataclasses.replace(config, rope_scaling=scaling)
    heads = None
    if config.architecture == "llama":
        if ".attn_q." in t.name:
            heads = config.num_attention_heads
        elif ".attn_k." in t.name:
            heads = config.num_key_value_heads
    name = hf_name(t.name)
    if types is not None:
        types[name] = t.qtype.name
    pw = None
    if packed is not None and len(t.shape) == 2:
        pw = pack_gguf_tensor(t, heads, slot) if kquants or t.qtype not in _SERVING_ONLY else None
        if pw is not None:
            packed[name] = pw
    if pw is not None and blocks_only:
        # the blocks are the weight: no dense copy (the model dequantizes where it uses one)
        tensors[name] = blocks_placeholder(t.shape, dtype)
        return config
    w = dequantize_tensor(t)
    if heads is not None:
        w = unpermute_qk(w, heads)
    tensors[name] = w.to(dtype)
    return config


_PACKERS = {Q.Q4_0: pack_q4_0_from_gguf, Q.Q4_1: pack_q4_1_from_gguf, Q.Q8_0: pack_q8_0_from_gguf,
            Q.Q5_0: pack_q5_0_from_gguf, Q.IQ4_NL: pack_iq4_nl_from_gguf, Q.IQ4_XS: pack_iq4_xs_from_gguf}
_K_KINDS = {Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}
# blocks packed only to be served from (`kquants`): decode's dense bfloat16 codes rebuild none of them
_SERVING_ONLY = frozenset({*_K_KINDS, Q.IQ4_NL, Q.IQ4_XS})


def pack_gguf_tensor(t: GGUFTensor, heads: int | None = None,
                     slot: tuple[Tensor, Tensor] | None = None) -> PackedWeight | None:
    """The 2-D tensor `t`'s blocks as a kernel weight, or None for a type the kernels do not take
    (F16/F32, a K-quant whose K is not whole superblocks). `heads`: undo llama.cpp's Q/K row order.
    `slot`: where a K-quant's tiles go (`fused_slots`)."""
    rows = None if heads is None else unpermute_qk(torch.arange(t.shape[0]), heads)
    if t.qtype in _K_KINDS:
        if t.shape[1] % kquant.SUPER:
            return None
        return kquant.pack_from_gguf(_K_KINDS[t.qtype], t.data, t.shape, rows, out=slot)
    if t.qtype not in _PACKERS:
        return None
    try:
        pw = _PACKERS[t.qtype](t.data, t.shape)
    except ValueError:
        if t.qtype != Q.IQ4_XS:
            raise
        return None   # a group scale past float16's range: served dense
    return pw if rows is None else pw.select_rows(rows)


def dequantize_tensor(t: GGUFTensor) -> Tensor:
    """A float tensor of `t.shape` that owns its memory (F32/F16 are copied out of the mmap)."""
    if t.qtype in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data))
    return torch.from_numpy(dequantize(t.data, t.qtype)).reshape(t.shape)
