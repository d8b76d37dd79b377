"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) as tiled `PackedWeight`s for kernels/qlinear_kquant.cpp.

A weight keeps its bytes: each row's superblock of 256 K values is first rewritten as a *row record*
of the same size (the codes' low nibbles paired as q4_1 pairs them, the high bits, scales and float16
factors as they are), and 16 rows' records become a tile's superblock by a fixed byte permutation
(`_permutation`), split into codes (`qs [T, S, 8 * QB]`) and scales (`scales [T, S, SB]`). Untiling
inverts it, so row selection (llama.cpp's Q/K order), concatenation and dequantization work on records.

Row records (per superblock; q = the 256 integer codes, group j = codes 32j..32j+31):
- Q4_K (144 bytes): d f16, dmin f16, GGUF's 12 scale bytes, then per group 16 bytes, byte k = q[k] |
  q[16+k] << 4.
- Q5_K (176): as Q4_K with the low 4 bits, then per group 4 bytes, byte i bit c = bit 4 of q[4c+i],
  bit 4+c = bit 4 of q[16+4c+i].
- Q6_K (210): d f16, the 16 int8 scales, per group 16 nibble bytes (low 4 bits), then per group 8 bytes,
  byte 4h+i bits 2c..2c+1 = bits 4..5 of q[16h+4c+i].
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model import kernels
from kiln.model.heap import huge_paged
from kiln.model.quant import _KIND_IDS, TILE_ROWS, GGUFData, PackedWeight

SUPER = 256


@dataclass(frozen=True)
class KFormat:
    kind: str
    gguf_bytes: int     # bytes of a GGUF block = a row record
    group_bytes: int    # a tile's codes for 32 K values
    scale_bytes: int    # a tile's scales for a superblock

    @property
    def super_bytes(self) -> int:
        return 8 * self.group_bytes


FORMATS = {
    "q4_k": KFormat("q4_k", 144, 256, 256),
    "q5_k": KFormat("q5_k", 176, 320, 256),
    "q6_k": KFormat("q6_k", 210, 384, 288),
}


@functools.cache
def _permutation(kind: str) -> Tensor:
    """For each byte of a tile's superblock (codes, then scales): the byte of the 16 row records
    (`row * record_bytes + offset`) it holds."""
    f = FORMATS[kind]
    rb = f.gguf_bytes
    src = np.full(TILE_ROWS * rb, -1, dtype=np.int64)
    nib0 = 18 if kind == "q6_k" else 16          # where the nibble bytes start in a record
    for r in range(TILE_ROWS):
        for j in range(8):
            g = j * f.group_bytes
            for c in range(4):
                for i in range(4):
                    src[g + c * 64 + r * 4 + i] = r * rb + nib0 + 16 * j + 4 * c + i
            if kind == "q5_k":
                for i in range(4):
                    src[g + 256 + r * 4 + i] = r * rb + 144 + 4 * j + i
            if kind == "q6_k":
                for h in range(2):
                    for i in range(4):
                        src[g + 256 + h * 64 + r * 4 + i] = r * rb + 146 + 8 * j + 4 * h + i
        s = f.super_bytes
        if kind == "q6_k":
            src[s + 2 * r: s + 2 * r + 2] = [r * rb, r * rb + 1]
            for k in range(16):
                src[s + 32 + k * 16 + r] = r * rb + 2 + k
        else:
            src[s + 2 * r: s + 2 * r + 2] = [r * rb, r * rb + 1]
            src[s + 32 + 2 * r: s + 32 + 2 * r + 2] = [r * rb + 2, r * rb + 3]
            for b in range(12):
                src[s + 64 + b * 16 + r] = r * rb + 4 + b
    assert sorted(src.tolist()) == list(range(TILE_ROWS * rb)), f"{kind}: the tile layout is not a permutation"
    return torch.from_numpy(src)


@functools.cache
def _inverse(kind: str) -> Tensor:
    perm = _permutation(kind)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


# ---------------------------------------------------------------- GGUF blocks -> row records


def _codes(kind: str, b: np.ndarray) -> np.ndarray:
    """The integer codes `[blocks, 8, 32]` (uint8) of GGUF blocks `b [blocks, gguf_bytes]`, in K order
    (gguf.quants' unpacking)."""
    nb = b.shape[0]
    if kind == "q6_k":
        ql, qh = b[:, :128], b[:, 128:192]
        lo = (ql.reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
        hi = (qh.reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        return (lo.reshape(nb, 8, 32) | (hi.reshape(nb, 8, 32) << 4)).astype(np.uint8)
    qs = b[:, -128:]
    q = (qs.reshape(nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    q = q.reshape(nb, 8, 32)
    if kind == "q5_k":
        qh = b[:, 16:48]
        hb = (qh.reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = q | (hb << 4)
    return q.astype(np.uint8)


def _q4_k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A record's 128 nibble bytes straight from GGUF Q4_K's `qs [blocks, 128]` (the load's bulk: no
    codes unpacked). GGUF byte 32c + l holds code l of group 2c (low nibble) and of group 2c + 1 (high);
    the record's byte k of group j holds codes k and 16 + k of it."""
    halves = qs.reshape(-1, 4, 2, 16)
    a, b = halves[:, :, 0], halves[:, :, 1]
    even = (a & 15) | (b << 4)
    odd = (a >> 4) | (b & 0xF0)
    return np.stack([even, odd], axis=2).reshape(-1, 128)


def _records(kind: str, b: np.ndarray) -> np.ndarray:
    """Row records `[blocks, gguf_bytes]` of GGUF blocks `[blocks, gguf_bytes]`."""
    nb = b.shape[0]
    if kind == "q4_k":
        return np.ascontiguousarray(np.concatenate([b[:, :16], _q4_k_nibbles(b[:, 16:])], axis=1))
    q = _codes(kind, b)
    nib = ((q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)).reshape(nb, 128)
    parts: list[np.ndarray]
    if kind == "q6_k":
        h2 = ((q >> 4) & 3).reshape(nb, 8, 2, 4, 4)   # [group, h, c, i]
        high = np.zeros((nb, 8, 2, 4), np.uint8)
        for c in range(4):
            high |= h2[:, :, :, c, :] << (2 * c)
        parts = [b[:, 208:210], b[:, 192:208], nib, high.reshape(nb, 64)]
    else:
        parts = [b[:, :16], nib]
        if kind == "q5_k":
            h1 = ((q >> 4) & 1).reshape(nb, 8, 2, 4, 4)
            high = np.zeros((nb, 8, 4), np.uint8)
            for h in range(2):
                for c in range(4):
                    high |= h1[:, :, h, c, :] << (4 * h + c)
            parts.append(high.reshape(nb, 32))
    return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.uint8)


def _gguf_rows(kind: str, data: GGUFData, shape: Sequence[int]) -> tuple[np.ndarray, int, int]:
    f = FORMATS[kind]
    if len(shape) != 2:
        raise ValueError(f"{kind}: expected a 2-D shape (out, in), got {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if k % SUPER:
        raise ValueError(f"{kind}: in_features {k} is not a multiple of {SUPER}")
    if isinstance(data, Tensor):
        raw = data.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
    else:
        raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    raw = raw.reshape(-1)
    expected = n * (k // SUPER) * f.gguf_bytes
    if raw.size != expected:
        raise ValueError(f"{kind}: {raw.size} bytes for shape {(n, k)}, expected {expected}")
    return raw.reshape(n * (k // SUPER), f.gguf_bytes), n, k


def tile_shapes(kind: str, n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of a `[n, k]` weight's tiled codes and scales: `[T, S, code bytes]`, `[T, S, scale bytes]`."""
    f, t, s = FORMATS[kind], -(-n // TILE_ROWS), k // SUPER
    return (t, s, f.super_bytes), (t, s, f.scale_bytes)


def pack_from_gguf(kind: str, data: GGUFData, shape: Sequence[int], rows: Tensor | None = None,
                   out: tuple[Tensor, Tensor] | None = None) -> PackedWeight:
    """GGUF K-quant blocks of a `[N, K]` tensor as a tiled weight (float activations); `rows`: the output
    rows to keep, in order (llama.cpp's Q/K permutation undone), else all. `out`: contiguous uint8
    tensors of `tile_shapes` (a fused weight's slices) that receive the codes and scales, else new ones."""
    blocks, n, k = _gguf_rows(kind, data, shape)
    keep = None if rows is None else torch.as_tensor(rows, dtype=torch.long)
    count = n if keep is None else int(keep.numel())
    module = kernels.load() if kernels.enabled() else None
    if module is not None:
        # one pass over the file's bytes in C++ (the numpy records and gather below took ~20 s of a 1B
        # model's load); the blocks are read, never written, so a read-only mapping is fine
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(blocks)
        if out is None:   # the weights decode streams: in 2 MiB pages (heap.huge_paged)
            qs_shape, sc_shape = tile_shapes(kind, count, k)
            out = (huge_paged(qs_shape, torch.uint8), huge_paged(sc_shape, torch.uint8))
        out_qs, out_scales = out
        qs, scales = module.kquant_tiles_from_gguf(src, _KIND_IDS[kind], count, k, keep, _permutation(kind),
                                                   FORMATS[kind].super_bytes, out_qs=out_qs, out_scales=out_scales)
        return PackedWeight(kind, count, k, qs, scales, True)  # type: ignore[arg-type]
    rec = torch.from_numpy(_records(kind, blocks)).view(n, k // SUPER, -1)
    if keep is not None:
        rec = rec[keep]
    pw = tile(kind, k, rec)
    if out is not None:
        pw.qs, pw.scales = out[0].copy_(pw.qs), out[1].copy_(pw.scales)
    return pw


# ---------------------------------------------------------------- records <-> tiles


def tile(kind: str, in_features: int, rec: Tensor, float_act: bool = True) -> PackedWeight:
    """Row records `[N, S, gguf_bytes]` (uint8) as a tiled weight; rows past N are zero (d = 0).
    `float_act`: multiplied with float activations, else 8-bit ones."""
    f = FORMATS[kind]
    n, s, rb = rec.shape
    t = -(-n // TILE_ROWS)
    if t * TILE_ROWS != n:
        rec = F.pad(rec, (0, 0, 0, 0, 0, t * TILE_ROWS - n))
    # [T, r, S, b] -> [T, S, r * rb + b], then the tile's byte order
    x = rec.reshape(t, TILE_ROWS, s, rb).permute(0, 2, 1, 3).reshape(t, s, TILE_ROWS * rb)
    x = x[..., _permutation(kind)]
    qs, scales = x[..., : f.super_bytes].contiguous(), x[..., f.super_bytes:].contiguous()
    return PackedWeight(kind, n, in_features, qs, scales, float_act)  # type: ignore[arg-type]


def records(p: PackedWeight) -> Tensor:
    """The row records `[out_features, S, gguf_bytes]` of a tiled K-quant weight."""
    f = FORMATS[p.kind]
    t, s, _ = p.qs.shape
    x = torch.cat([p.qs, p.scales], dim=-1)[..., _inverse(p.kind)]
    return x.reshape(t, s, TILE_ROWS, f.gguf_bytes).permute(0, 2, 1, 3).reshape(t * TILE_ROWS, s, -1)[: p.out_features]


def select_rows(p: PackedWeight, index: Tensor | Sequence[int]) -> PackedWeight:
    idx = torch.as_tensor(index, dtype=torch.long)
    return tile(p.kind, p.in_features, records(p)[idx], p.float_act)


def concat(parts: Sequence[PackedWeight]) -> PackedWeight:
    if all(p.out_features % TILE_ROWS == 0 for p in parts[:-1]):
        # whole tiles stack as they are (a tile's 16 rows are independent of its neighbours)
        return PackedWeight(parts[0].kind, sum(p.out_features for p in parts), parts[0].in_features,
                            torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),
                            parts[0].float_act)
    return tile(parts[0].kind, parts[0].in_features, torch.cat([records(p) for p in parts]), parts[0].float_act)


def dequantize(p: PackedWeight) -> Tensor:
    """float32 `[out_features, in_features]`, computed as gguf.quants.dequantize computes it. The codes
    are unpacked in bytes and widened once (the dense path dequantizes a weight on every use)."""
    rec = records(p)
    n, s, _ = rec.shape
    raw = rec.reshape(n * s, -1)

    def f16(at: int) -> Tensor:
        return raw[:, at: at + 2].contiguous().view(torch.float16).float()

    if p.kind == "q6_k":
        nib = raw[:, 18:146].reshape(-1, 8, 16)
        high = raw[:, 146:210].reshape(-1, 8, 2, 1, 4) >> _SHIFTS_2[p.device.type]
        q = torch.cat([nib & 15, nib >> 4], dim=-1) | ((high & 3).reshape(-1, 8, 32) << 4)
        sc = raw[:, 2:18].contiguous().view(torch.int8).float()
        d = (f16(0) * sc).reshape(-1, 16, 1)
        # q - 32 is exact in float32, so this is d * (q - 32) as gguf computes it
        w = q.reshape(-1, 16, 16).float().sub_(32).mul_(d)
        return w.reshape(n, s * SUPER)
    nib = raw[:, 16:144].reshape(-1, 8, 16)
    q = torch.cat([nib & 15, nib >> 4], dim=-1)
    if p.kind == "q5_k":
        hb = raw[:, 144:176].reshape(-1, 8, 1, 1, 4) >> _SHIFTS_1[p.device.type]
        q = q | ((hb & 1).reshape(-1, 8, 32) << 4)
    b = raw[:, 4:16].to(torch.int32)
    sc = torch.cat([b[:, 0:4] & 63, (b[:, 8:12] & 15) | ((b[:, 0:4] >> 6) << 4)], dim=1).float()
    mn = torch.cat([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], dim=1).float()
    d = (f16(0) * sc)[..., None]
    dm = (f16(2) * mn)[..., None]
    return q.float().mul_(d).sub_(dm).reshape(n, s * SUPER)


class _Shifts(dict):
    """Per device type, the uint8 shift amounts that spread packed high bits over their codes."""

    def __init__(self, shape: tuple[int, ...], values: list[int]) -> None:
        super().__init__()
        self._shape, self._values = shape, values

    def __missing__(self, device: str) -> Tensor:
        t = torch.tensor(self._values, dtype=torch.uint8, device=device).reshape(self._shape)
        self[device] = t
        return t


# Q6_K: bits 2c..2c+1 of a high byte; Q5_K: bit 4h+c
_SHIFTS_2 = _Shifts((1, 1, 1, 4, 1), [0, 2, 4, 6])
_SHIFTS_1 = _Shifts((1, 1, 2, 4, 1), [4 * h + c for h in range(2) for c in range(4)])
