"""Rotary position embedding: inverse frequencies per scaling type, and cached cos/sin tables.

Frequencies are computed in float32 exactly as transformers does, so logits match it bit for bit
up to kernel rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from kiln.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim/2] float32 on CPU, attention scaling applied to cos/sin)."""
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = scaling["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling, exponents)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    return inv_freq, 1.0


def _llama3(inv_freq: Tensor, s: dict) -> Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(config: ModelConfig, s: dict, exponents: Tensor) -> tuple[Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    original = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryTables(nn.Module):
    """cos and sign-folded sin per position, `[n, head_dim]` in the model dtype.

    `sin_signed` carries rotate-half's minus sign so rotation is `x*cos + roll(x, d/2)*sin_signed`.
    Tables start at `max_position_embeddings` and grow on demand (dynamic NTK recomputes on growth,
    as transformers does).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(0, config.head_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_signed", torch.empty_like(self.cos), persistent=False)
        self.ensure(config.max_position_embeddings)

    @property
    def length(self) -> int:
        return int(self.cos.shape[0])

    def ensure(self, n: int) -> None:
        if n <= self.length:
            return
        dynamic = (self.config.rope_scaling or {}).get("rope_type") == "dynamic"
        if not dynamic:  # amortise growth; dynamic NTK must use the exact length, as transformers does
            n = max(n, self.length * 2)
        inv_freq, scale = rope_inv_freq(self.config, seq_len=n)
        device = self.cos.device
        freqs = torch.arange(n, dtype=torch.int64, device=device).float()[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scale
        sin = emb.sin() * scale
        half = self.config.head_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        dtype = self.cos.dtype
        self.cos = cos.to(dtype)
        self.sin_signed = sin_signed.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x `[..., heads, head_dim]`; cos/sin broadcastable to it."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
