"""Batched multi-adapter LoRA (S-LoRA / punica style): stacked A/B tensors and a per-token slot index.

The base projection runs once for the whole batch; each token then adds its own low-rank delta
`(x @ A[slot].T) @ B[slot]` from the bank, so requests on different adapters (and the base, slot 0,
whose factors are zero) share every step. The C++ kernel (kernels/lora_bgmv.cpp) takes every row of
the step in one call, decodes and prefill chunks alike, reading each row's slot's factors in place.
torch's fallback gathers the decode rows' factors for a bmm, and multiplies a prefill chunk (one
sequence) by its slot's factors directly (SGMV over one segment).
Adapters are never merged into the base weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import Tensor

from kiln.model import kernels
from kiln.model.config import ModelConfig

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection LoRA can target."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        "q_proj": (h, cfg.num_attention_heads * d),
        "k_proj": (h, cfg.num_key_value_heads * d),
        "v_proj": (h, cfg.num_key_value_heads * d),
        "o_proj": (cfg.num_attention_heads * d, h),
        "gate_proj": (h, cfg.intermediate_size),
        "up_proj": (h, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, h),
    }


@dataclass
class LoraStep:
    """Per-step routing: which slot each flat token uses. Built once per step, shared by every layer."""

    decode_slots: Tensor | None                 # [Bd] slot per decode token (None: no decode uses LoRA)
    num_decode: int
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (start, length, slot), slot > 0

    @cached_property
    def row_slots(self) -> Tensor | None:
        """[T'] slot per flat token up to the last one with an adapter, for the CPU kernel: decodes and
        prefill chunks in one call (without segments, the decode slots; None: no row has an adapter)."""
        if not self.segments:
            return self.decode_slots
        end = max(start + length for start, length, _ in self.segments)
        rows = torch.zeros(end, dtype=torch.long)
        if self.decode_slots is not None:
            rows[: self.num_decode] = self.decode_slots.cpu()
        for start, length, slot in self.segments:
            rows[start : start + length] = slot
        return rows


class LoraBank:
    """Factors of every loaded adapter revision, stacked by slot. Slot 0 is the base model (zeros)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.cfg = cfg
        self.shapes = module_shapes(cfg)
        self.num_slots = num_slots
        self.rank = rank
        self.dtype = dtype
        self.device = device
        # CPU matmuls of bfloat16 at these tiny shapes are far slower than float32: a bfloat16 bank
        # (half the bytes for the kernel to stream) is computed with in float32 there
        self.compute_dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        n_layers = cfg.num_hidden_layers
        # A: [L, S, R, in]; B transposed, [L, S, R, out], with the adapter's scale folded in: both are
        # rank-major, so one slot's factors are contiguous rows the kernel streams through
        self.a = {m: torch.zeros(n_layers, num_slots, rank, i, dtype=dtype, device=device)
                  for m, (i, _) in self.shapes.items()}
        self.b = {m: torch.zeros(n_layers, num_slots, rank, o, dtype=dtype, device=device)
                  for m, (_, o) in self.shapes.items()}
        # per-layer views, made once: indexing a tensor per projection call is a measurable cost
        self.a_layers = {m: list(t.unbind(0)) for m, t in self.a.items()}
        self.b_layers = {m: list(t.unbind(0)) for m, t in self.b.items()}
        # which modules any slot uses: skip the rest entirely
        self.used: dict[str, set[int]] = {m: set() for m in MODULES}

    def grown(self, num_slots: int, rank: int) -> LoraBank:
        """A bigger bank holding the same factors (ranks zero-padded, which is exact)."""
        new = LoraBank(self.cfg, max(num_slots, self.num_slots), max(rank, self.rank), self.dtype, self.device)
        for m in MODULES:
            new.a[m][:, : self.num_slots, : self.rank] = self.a[m]
            new.b[m][:, : self.num_slots, : self.rank] = self.b[m]
        new.used = {m: set(s) for m, s in self.used.items()}
        return new

    def set_slot(self, slot: int, modules: Mapping[tuple[int, str], tuple[Tensor, Tensor, float]]) -> None:
        """Write one adapter's factors into `slot` (rank <= bank rank; the caller grows the bank first)."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"slot {slot} is outside 1..{self.num_slots - 1}")
        self.clear_slot(slot)
        for (layer, name), (a, b, scale) in modules.items():
            r = a.shape[0]
            if r > self.rank:
                raise ValueError(f"rank {r} exceeds the bank rank {self.rank}")
            self.a[name][layer, slot, :r] = a.to(self.dtype)
            self.b[name][layer, slot, :r] = (b.float().T * scale).to(self.dtype)
            self.used[name].add(slot)

    def clear_slot(self, slot: int) -> None:
        for m in MODULES:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
            self.used[m].discard(slot)

    def apply(self, y: Tensor, x: Tensor, layer: int, name: str, step: LoraStep) -> Tensor:
        """`y` (the base projection of flat tokens `x`) plus each token's LoRA delta, in place."""
        if not self.used[name]:
            return y
        a, b = self.a_layers[name][layer], self.b_layers[name][layer]
        module = _kernel(x, a)
        if module is not None:
            if step.row_slots is not None:
                module.lora_bgmv_add(y, x, a, b, step.row_slots)
            return y
        cd = self.compute_dtype
        if step.decode_slots is not None:
            # index_select, not a[slots]: advanced indexing of a 3-D tensor costs milliseconds on CPU
            xd = x[: step.num_decode].unsqueeze(1).to(cd)                                   # [Bd, 1, in]
            xa = torch.bmm(xd, a.index_select(0, step.decode_slots).to(cd).transpose(1, 2))  # [Bd, 1, R]
            yd = torch.bmm(xa, b.index_select(0, step.decode_slots).to(cd)).squeeze(1)     # [Bd, out]
            y[: step.num_decode] += yd.to(y.dtype)
        for start, length, slot in step.segments:
            if slot not in self.used[name]:
                continue
            seg = x[start : start + length].to(cd)
            y[start : start + length] += ((seg @ a[slot].to(cd).T) @ b[slot].to(cd)).to(y.dtype)
        return y

    def delta(self, x: Tensor, layer: int, name: str, step: LoraStep) -> Tensor | None:
        """The LoRA contribution alone for flat tokens `x` `[T, in]`, or None when no token has one."""
        if not self.used[name]:
            return None
        out = torch.zeros(x.shape[0], self.shapes[name][1], dtype=x.dtype, device=x.device)
        return self.apply(out, x, layer, name, step)


def _kernel(x: Tensor, a: Tensor):
    """The compiled BGMV kernel when it applies here (CPU, float32 or bfloat16 factors, no autograd)."""
    if a.dtype not in KERNEL_DTYPES or x.dtype not in KERNEL_DTYPES:
        return None
    return kernels.for_tensor(x)


# the dtypes the BGMV kernel takes, for activations and factors alike
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class LoraDelta(Protocol):
    """Anything that adds a low-rank delta to a projection: the serving bank or trainable factors."""

    def apply(self, y: Tensor, x: Tensor, layer: int, name: str) -> Tensor:
        """`y` (the base projection of `x`) plus the delta; in place where autograd allows."""
        ...


@dataclass
class BankRouting:
    """The bank plus this step's slot routing, as a LoraDelta for the paged forward."""

    bank: LoraBank
    step: LoraStep

    def apply(self, y: Tensor, x: Tensor, layer: int, name: str) -> Tensor:
        return self.bank.apply(y, x, layer, name, self.step)


@dataclass
class DenseRouting:
    """The bank plus a routing of flat tokens, as a LoraDelta for `forward_dense`'s `[B, T, in]`
    activations (prompt scoring under an adapter): the tokens are routed as one flat run."""

    bank: LoraBank
    step: LoraStep

    def apply(self, y: Tensor, x: Tensor, layer: int, name: str) -> Tensor:
        flat = self.bank.apply(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(), layer, name,
                               self.step)
        return flat.view(y.shape)


def build_lora_step(slots: list[int], lengths: list[int], num_decode: int, device: torch.device) -> LoraStep | None:
    """`slots`/`lengths`: one entry per scheduled item in flat order (decodes first). None: all base."""
    if not any(slots):
        return None
    decode = slots[:num_decode]
    decode_slots = torch.tensor(decode, dtype=torch.long, device=device) if any(decode) else None
    segments = []
    start = num_decode
    for slot, n in zip(slots[num_decode:], lengths[num_decode:], strict=True):
        if slot:
            segments.append((start, n, slot))
        start += n
    return LoraStep(decode_slots, num_decode, segments)
