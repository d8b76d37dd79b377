"""Quantized linear weights (q4_1, q8_0 in groups of 32 along K) and `y = x @ W^T` over them.

`quant_linear` runs the C++ kernel (kiln/model/kernels) on the CPU: it quantizes the activations to
int8 per group of 32 and does integer dot products, reading the weights once per call however many
rows `x` has. Without the kernel (no compiler, `KILN_DISABLE_KERNELS=1` at import, CUDA, or autograd
through `x`) it dequantizes once, caches the dense weight, and calls `F.linear`.

Tiled layout (N padded to tiles of 16 output rows; G = ceil(K / 32) groups; r = row in the tile):
- q4_1 (value = d*q + m, q in 0..15): `qs` uint8 `[T, G, 256]`, byte `c*64 + r*4 + i` (c < 4) holds
  q[r, 4c+i] in the low nibble and q[r, 16+4c+i] in the high one; `scales` float16 `[T, G, 32]`:
  the 16 rows' d, then their m.
- q8_0 (value = d*q, q in -128..127): `qs` uint8 `[T, G, 512]`, byte `c*64 + r*4 + i` = q[r, 4c+i] + 128;
  `scales` float16 `[T, G, 16]`.
- iq4_nl (value = d*IQ4_VALUES[q], q in 0..15): q4_1's `qs`, q8_0's `scales`; 8-bit activations only (the
  kernel looks each code up and goes on as for q8_0); `as_q8_0` gives the same values as q8_0 tiles.
GGUF Q4_1 / Q8_0 / IQ4_NL repack exactly (same float16 d, m and codes); Q4_0 (d*(q-8)) becomes d, m = -8d;
IQ4_XS becomes iq4_nl with each group's scale d*(ls-32) in float16.

K-quants ("q4_k", "q5_k", "q6_k": GGUF Q4_K / Q5_K / Q6_K, superblocks of 256 along K) keep their own
bytes, moved into tiles of 16 rows (kernels/qlinear_kquant.cpp documents the layout) by a fixed byte
permutation of the 16 rows' superblocks (kiln/model/kquant.py): the same 4.5 / 5.5 / 6.5625 bits a
weight, multiplied with float activations (`float_act`) or with 8-bit ones per superblock of 256.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model import kernels
from kiln.model.heap import huge_paged_cat, huge_paged_copy

Kind = Literal["q4_1", "q8_0", "iq4_nl", "q4_k", "q5_k", "q6_k"]
GROUP = 32
TILE_ROWS = 16
_KIND_IDS = {"q4_1": 0, "q8_0": 1, "iq4_nl": 2, "q4_k": 0, "q5_k": 1, "q6_k": 2}
K_KINDS = frozenset({"q4_k", "q5_k", "q6_k"})
_TINY_AMAX = 1e-30   # activation groups below this quantize to zero (as in the kernel)
# IQ4_NL / IQ4_XS: a 4-bit code stands for one of these 16 int8 values (llama.cpp's kvalues_iq4nl), times its
# group's scale (kernels/qlinear.cpp's kIq4Values)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_TABLE = torch.tensor(IQ4_VALUES, dtype=torch.int8)
# tiles (of 16 rows) dequantized at a time: 4096 rows of a 2048-wide weight hold ~32 MB of float32
DEQUANT_CHUNK_TILES = 256


def blocks_placeholder(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """A `shape` tensor that holds no memory (one element, stride 0 everywhere): what a module's dense
    weight is when the weight lives only in its quantized blocks (`holds_no_values`)."""
    return torch.zeros((), dtype=dtype).expand(*shape)


def holds_no_values(t: Tensor) -> bool:
    """Whether `t` is a `blocks_placeholder` (every stride 0 over more than one element)."""
    return t.numel() > 1 and all(s == 0 for s in t.stride())


@dataclass
class QuantCodes:
    """Row-major form of a quantized weight: codes `q [N, G*32]` (uint8 0..15 for q4_1 and iq4_nl, int8
    for q8_0), float16 scales `d [N, G]` and, for q4_1, float16 mins `m [N, G]`."""

    kind: Kind
    in_features: int
    q: Tensor
    d: Tensor
    m: Tensor | None


@dataclass(eq=False)
class PackedWeight:
    kind: Kind
    out_features: int
    in_features: int
    qs: Tensor = field(repr=False)
    scales: Tensor = field(repr=False)
    # float activations (kernels/qlinear_float.cpp: the dequantized weight's product up to float32
    # rounding) instead of int8 ones per group of 32 (kernels/qlinear.cpp, llama.cpp's arithmetic; K-quant
    # weights: per superblock of 256, kernels/qlinear_kquant_q8.cpp)
    float_act: bool = False
    _dense: dict[tuple[torch.dtype, torch.device], Tensor] = field(default_factory=dict, repr=False)

    @property
    def groups(self) -> int:
        return self.qs.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def is_kquant(self) -> bool:
        return self.kind in K_KINDS

    def codes(self) -> QuantCodes:
        if self.is_kquant:
            raise ValueError(f"{self.kind} weights have no q4_1 / q8_0 codes")
        return _untile(self)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: Tensor | None = None, *,
                   torch_threads: bool = False) -> Tensor:
        """`[out_features, in_features]`; values are computed in float32 (d*q + m), then cast (K-quants:
        as gguf.quants.dequantize computes them). Large weights go a few thousand rows at a time, so the
        temporaries beside the result stay small (the dense path dequantizes a weight on every use).
        `out` (that shape and dtype, contiguous) receives the values and is returned: a buffer reused
        call after call spares the pages a fresh tensor of a projection's size faults in.
        `torch_threads`: the C++ pass shares the work out on torch's intra-op threads, not the kernels'
        pool (a training step, whose matmuls keep torch's threads spinning between the calls)."""
        tiles = self.qs.shape[0]
        module = self._kquant_module(dtype)
        if module is not None:
            # one pass in C++: training from blocks dequantizes every projection twice a step, which the
            # torch path below made 3-4x a dense copy's step at 1B
            return module.kquant_dequantize(self.qs, self.scales, _KIND_IDS[self.kind], self.out_features,
                                            self.in_features, dtype == torch.bfloat16, out=out,
                                            torch_threads=torch_threads)
        if out is not None:
            return out.copy_(self.dequantize(dtype))
        if tiles <= DEQUANT_CHUNK_TILES:
            return self._dequantize_whole(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.device)
        for t0 in range(0, tiles, DEQUANT_CHUNK_TILES):
            part = self._tile_range(t0, t0 + DEQUANT_CHUNK_TILES)
            out[t0 * TILE_ROWS: t0 * TILE_ROWS + part.out_features] = part._dequantize_whole(dtype)
        return out

    def dequantize_t(self, dtype: torch.dtype, start: int, stop: int, out: Tensor | None = None, *,
                     torch_threads: bool = False) -> Tensor:
        """The columns `start:stop` (whole superblocks of a K-quant) of `dequantize(dtype)`, transposed:
        `[stop - start, out_features]`, contiguous, the same values. A product with the weight as its
        right-hand side (`grad @ W`, a backward's) multiplies faster from this layout, and a range of
        columns is a range of that product's outputs. `out` as in `dequantize`."""
        module = self._kquant_module(dtype)
        if module is not None:
            return module.kquant_dequantize_t(self.qs, self.scales, _KIND_IDS[self.kind], self.out_features,
                                              self.in_features, start, stop, dtype == torch.bfloat16, out=out,
                                              torch_threads=torch_threads)
        cols = self.dequantize(dtype)[:, start:stop].t()
        return cols.contiguous() if out is None else out.copy_(cols)

    def input_grad(self, grad: Tensor, *, isa: str | None = None) -> Tensor | None:
        """`grad @ dequantize(bfloat16)` in float32 for float32 `grad [..., out_features]`, multiplied
        straight from K-quant tiles in C++ (kernels/kquant_input_grad.cpp): each output one chain of fused
        multiply-adds over the weight's rows in order, so every ISA, thread count and batch gives the
        same bits. None where the kernels do not run it (not a K-quant, not on the CPU, kernels off)."""
        module = self._kquant_module(torch.float32)
        if module is None or grad.dtype != torch.float32 or not grad.is_cpu:
            return None
        rows = grad.reshape(-1, self.out_features)
        out = module.kquant_input_grad(self.qs, self.scales, _KIND_IDS[self.kind], self.out_features,
                                       self.in_features, rows, -1 if isa is None else kernels.ISA_LEVELS[isa])
        return out.reshape(*grad.shape[:-1], self.in_features)

    def _kquant_module(self, dtype: torch.dtype) -> Any:
        """The C++ kernels where they dequantize this weight into `dtype` (K-quant tiles on the CPU)."""
        if self.is_kquant and dtype in (torch.float32, torch.bfloat16) and self.qs.is_cpu and kernels.enabled():
            return kernels.load()
        return None

    def dequantize_rows(self, index: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """The output rows `index` (any shape of row numbers) dequantized, `[*index.shape, in_features]`:
        only the tiles holding them are read (an embedding's looked-up rows)."""
        flat = index.reshape(-1).to(torch.long)
        tiles, where = torch.unique(flat // TILE_ROWS, return_inverse=True)
        part = PackedWeight(self.kind, tiles.numel() * TILE_ROWS, self.in_features, self.qs[tiles],
                            self.scales[tiles], self.float_act)
        # dequantize(), not _dequantize_whole(): K-quant tiles then go through the C++ pass (the same
        # values), ~10x less time for a 500-token prompt's rows of a 1B model's Q6_K table
        rows = part.dequantize(dtype)[where * TILE_ROWS + flat % TILE_ROWS]
        return rows.view(*index.shape, self.in_features)

    def _tile_range(self, start: int, stop: int) -> PackedWeight:
        """The tiles `start:stop` as a weight of their rows (views of the same storage)."""
        stop = min(stop, self.qs.shape[0])
        n = min(self.out_features, stop * TILE_ROWS) - start * TILE_ROWS
        return PackedWeight(self.kind, n, self.in_features, self.qs[start:stop], self.scales[start:stop],
                            self.float_act)

    def _dequantize_whole(self, dtype: torch.dtype) -> Tensor:
        if self.is_kquant:
            from kiln.model import kquant

            return kquant.dequantize(self).to(dtype)
        c = self.codes()
        n, g = c.d.shape
        q = (_IQ4_TABLE[c.q.long()] if c.kind == "iq4_nl" else c.q).reshape(n, g, GROUP).float()
        w = c.d.float()[..., None] * q
        if c.m is not None:
            w = w + c.m.float()[..., None]
        return w.reshape(n, g * GROUP)[:, : self.in_features].to(dtype)

    def select_rows(self, index: Tensor | Sequence[int]) -> PackedWeight:
        """The output rows `index` (any order, e.g. undoing llama.cpp's Q/K permutation)."""
        if self.is_kquant:
            from kiln.model import kquant

            return kquant.select_rows(self, index)
        c = self.codes()
        idx = torch.as_tensor(index, dtype=torch.long, device=c.q.device)
        m = None if c.m is None else c.m[idx]
        out = _tile(QuantCodes(c.kind, c.in_features, c.q[idx], c.d[idx], m))
        out.float_act = self.float_act
        return out

    def as_q8_0(self) -> PackedWeight:
        """An iq4_nl weight as q8_0 tiles of its values (what float activations multiply with: no float
        kernel reads codes through IQ4's table); any other kind as it is."""
        if self.kind != "iq4_nl":
            return self
        c = self.codes()
        out = _tile(QuantCodes("q8_0", c.in_features, _IQ4_TABLE[c.q.long()], c.d, None))
        out.float_act = self.float_act
        return out

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.kind, self.out_features, self.in_features, self.qs.to(device), self.scales.to(device),
                            self.float_act)


# ---------------------------------------------------------------- tiling


def _tile(c: QuantCodes) -> PackedWeight:
    n = c.q.shape[0]
    if c.kind in ("q4_1", "iq4_nl"):
        q = c.q.reshape(n, -1, GROUP)
        blocks = q[..., :16] | (q[..., 16:] << 4)
    else:
        blocks = c.q.reshape(n, -1, GROUP).view(torch.uint8) ^ 0x80
    return _tile_blocks(c.kind, c.in_features, blocks, c.d, c.m)


def _tile_blocks(kind: Kind, in_features: int, blocks: Tensor, d: Tensor, m: Tensor | None) -> PackedWeight:
    """Tile per-group bytes `[N, G, 16 | 32]`: for q4_1 byte j holds codes j (low nibble) and j + 16
    (high), as in GGUF; for q8_0 byte j is code j + 128. Both map onto tiles by a permutation."""
    n, g, nb = blocks.shape
    t = -(-n // TILE_ROWS)
    pad = t * TILE_ROWS - n
    if pad:
        blocks = F.pad(blocks, (0, 0, 0, 0, 0, pad))
        d = F.pad(d, (0, 0, 0, pad))
        m = None if m is None else F.pad(m, (0, 0, 0, pad))
    # [T, r, G, c] -> [T, G, c, r], moving the 4 bytes (i) of each lane as one int32
    lanes = blocks.contiguous().view(torch.int32).reshape(t, TILE_ROWS, g, nb // 4)
    # One copy, straight into the 2 MiB pages the kernels read from.
    qs = huge_paged_copy(lanes.permute(0, 2, 3, 1)).view(torch.uint8).reshape(t, g, nb * TILE_ROWS)
    parts = [d] if m is None else [d, m]
    scales = torch.cat([p.reshape(t, TILE_ROWS, g).permute(0, 2, 1) for p in parts], dim=-1)
    return PackedWeight(kind, n, in_features, qs, huge_paged_copy(scales))


def _untile(p: PackedWeight) -> QuantCodes:
    t, g, qb = p.qs.shape
    n = p.out_features
    nb = qb // TILE_ROWS
    # [T, G, c, r] -> [T, r, G, c] (int32 lanes of 4 bytes)
    lanes = p.qs.view(torch.int32).view(t, g, nb // 4, TILE_ROWS).permute(0, 3, 1, 2).contiguous()
    blocks = lanes.view(torch.uint8).reshape(t * TILE_ROWS, g, nb)[:n]
    if p.kind in ("q4_1", "iq4_nl"):
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, g * GROUP)
    else:
        q = (blocks ^ 0x80).view(torch.int8).reshape(n, g * GROUP)
    sc = p.scales.view(t, g, -1, TILE_ROWS).permute(2, 0, 3, 1).reshape(-1, t * TILE_ROWS, g)[:, :n]
    return QuantCodes(p.kind, p.in_features, q, sc[0], sc[1] if p.kind == "q4_1" else None)


def joined_view(parts: Sequence[Tensor]) -> Tensor | None:
    """`torch.cat(parts)` as a view, when the parts are contiguous and consecutive in one storage (each
    starts where the one before it ends); else None."""
    first = parts[0]
    end = first.data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.data_ptr() != end):
            return None
        end += p.nbytes
    shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
    return torch.as_strided(first, shape, first.stride(), first.storage_offset())


def concat_packed(parts: Sequence[PackedWeight]) -> PackedWeight:
    """Stack weights along the output dimension (e.g. q/k/v or gate/up) so one call computes all."""
    if not parts:
        raise ValueError("concat_packed needs at least one weight")
    first = parts[0]
    for p in parts[1:]:
        if p.kind != first.kind or p.in_features != first.in_features:
            raise ValueError(
                f"cannot concatenate {p.kind} [*, {p.in_features}] with {first.kind} [*, {first.in_features}]"
            )
    n = sum(p.out_features for p in parts)
    if all(p.out_features % TILE_ROWS == 0 for p in parts[:-1]):
        # whole tiles: the layouts simply stack (with no copy where the loader packed the parts into
        # consecutive slices of one buffer)
        qs = joined_view([p.qs for p in parts])
        scales = joined_view([p.scales for p in parts])
        if qs is None or scales is None:
            qs, scales = huge_paged_cat([p.qs for p in parts]), huge_paged_cat([p.scales for p in parts])
        return PackedWeight(first.kind, n, first.in_features, qs, scales, first.float_act)
    if first.is_kquant:
        from kiln.model import kquant

        return kquant.concat(parts)
    codes = [p.codes() for p in parts]
    m = None if first.kind == "q8_0" else torch.cat([c.m for c in codes])  # type: ignore[misc]
    out = _tile(QuantCodes(first.kind, first.in_features, torch.cat([c.q for c in codes]),
                           torch.cat([c.d for c in codes]), m))
    out.float_act = first.float_act
    return out


# ---------------------------------------------------------------- packing from float


def _groups_of(weight: Tensor) -> tuple[Tensor, int]:
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    pad = -k % GROUP
    if pad:
        # repeat the last column: the padding cannot widen the last group's range
        w = F.pad(w[None], (0, pad), mode="replicate")[0]
    return w.view(n, -1, GROUP), k


def _check_scales(*scales: Tensor) -> None:
    for s in scales:
        if not bool(torch.isfinite(s).all()):
            raise ValueError("weight values out of float16 scale range (or not finite); cannot quantize")


def pack_q4_1(weight: Tensor) -> PackedWeight:
    """Quantize a float weight `[N, K]` to q4_1 (per group: d = (max - min) / 15, m = min)."""
    wg, k = _groups_of(weight)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    _check_scales(d, m)
    df, mf = d.float()[..., None], m.float()[..., None]
    q = torch.where(df > 0, torch.round((wg - mf) / df.clamp_min(1e-45)), 0.0).clamp_(0, 15)
    return _tile(QuantCodes("q4_1", k, q.to(torch.uint8).view(wg.shape[0], -1), d, m))


def pack_q8_0(weight: Tensor) -> PackedWeight:
    """Quantize a float weight `[N, K]` to q8_0 (per group: d = max|w| / 127)."""
    wg, k = _groups_of(weight)
    d = (wg.abs().amax(-1) / 127).half()
    _check_scales(d)
    df = d.float()[..., None]
    q = torch.where(df > 0, torch.round(wg / df.clamp_min(1e-45)), 0.0).clamp_(-127, 127)
    return _tile(QuantCodes("q8_0", k, q.to(torch.int8).view(wg.shape[0], -1), d, None))


def pack_iq4_nl(weight: Tensor) -> PackedWeight:
    """Quantize a float weight `[N, K]` to iq4_nl: per group the scale that puts its largest magnitude on
    the table's -127 end, each value then the table's nearest."""
    wg, k = _groups_of(weight)
    peak = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))[..., 0]
    d = (peak / -127).half()
    _check_scales(d)
    df = d.float()[..., None]
    scaled = torch.where(df != 0, wg / torch.where(df != 0, df, 1.0), 0.0)
    q = (scaled[..., None] - _IQ4_TABLE.float()).abs().argmin(-1)
    return _tile(QuantCodes("iq4_nl", k, q.to(torch.uint8).view(wg.shape[0], -1), d, None))


# ---------------------------------------------------------------- packing GGUF blocks

GGUFData = bytes | bytearray | memoryview | np.ndarray | Tensor


def _gguf_blocks(data: GGUFData, shape: Sequence[int], block_bytes: int, name: str) -> tuple[Tensor, int, int]:
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D shape (out, in), got {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if k % GROUP:
        raise ValueError(f"{name}: in_features {k} is not a multiple of {GROUP}")
    return _gguf_raw(data, n * (k // GROUP) * block_bytes, name, (n, k)).view(-1, block_bytes), n, k


def _gguf_raw(data: GGUFData, expected: int, name: str, shape: tuple[int, int]) -> Tensor:
    """A tensor's block bytes as an owned uint8 tensor, checked to be `expected` bytes long."""
    if isinstance(data, Tensor):
        raw = data.detach().cpu().contiguous().view(torch.uint8).reshape(-1).clone()
    else:
        arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        raw = torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True).reshape(-1))
    if raw.numel() != expected:
        raise ValueError(f"{name}: {raw.numel()} bytes for shape {shape}, expected {expected}")
    return raw


def _f16(blocks: Tensor, start: int) -> Tensor:
    """The float16 at byte `start` of every block (copied as int16: a strided byte copy is slow)."""
    return blocks.view(torch.int16)[:, start // 2].contiguous().view(torch.float16)


def pack_q4_1_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF Q4_1 blocks (d f16, m f16, 16 bytes) of a `[N, K]` tensor; dequantizes bit-identically."""
    b, n, k = _gguf_blocks(data, shape, 20, "Q4_1")
    d, m = _f16(b, 0).view(n, -1), _f16(b, 2).view(n, -1)
    return _tile_blocks("q4_1", k, b[:, 4:].reshape(n, -1, 16), d, m)


def pack_q4_0_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF Q4_0 blocks (d f16, 16 bytes; value d*(q-8)) as q4_1 with m = -8d (exact in float16)."""
    b, n, k = _gguf_blocks(data, shape, 18, "Q4_0")
    d = _f16(b, 0).view(n, -1)
    m = (d.float() * -8).half()
    _check_scales(m)
    return _tile_blocks("q4_1", k, b[:, 2:].reshape(n, -1, 16), d, m)


def pack_q8_0_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF Q8_0 blocks (d f16, 32 int8) of a `[N, K]` tensor; dequantizes bit-identically."""
    b, n, k = _gguf_blocks(data, shape, 34, "Q8_0")
    return _tile_blocks("q8_0", k, (b[:, 2:] ^ 0x80).reshape(n, -1, 32), _f16(b, 0).view(n, -1), None)


def pack_q5_0_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF Q5_0 blocks (d f16, 4 bytes of fifth bits, 16 bytes of nibbles; value d * (q - 16), q in 0..31)
    as q8_0 tiles: the same d, q - 16 as the int8 code, so they dequantize bit-identically (8.5 bits a
    weight where the file holds 5.5: no kernel reads five-bit codes)."""
    b, n, k = _gguf_blocks(data, shape, 22, "Q5_0")
    high = b[:, 2:6].contiguous().view(torch.int32)             # bit j: the fifth bit of value j
    j = torch.arange(32, dtype=torch.int32)
    fifth = ((high >> j) & 1).to(torch.uint8)                    # [blocks, 32]
    nib = b[:, 6:]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1) | (fifth << 4)   # 0..31
    return _tile_blocks("q8_0", k, (q + 112).reshape(n, -1, 32), _f16(b, 0).view(n, -1), None)   # q - 16 + 128


def pack_iq4_nl_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF IQ4_NL blocks (d f16, 16 bytes of codes as Q4_0 holds them; value d * IQ4_VALUES[code]) of a
    `[N, K]` tensor as iq4_nl tiles: the same d and codes, so they dequantize bit-identically."""
    b, n, k = _gguf_blocks(data, shape, 18, "IQ4_NL")
    return _tile_blocks("iq4_nl", k, b[:, 2:].reshape(n, -1, 16), _f16(b, 0).view(n, -1), None)


IQ4_XS_SUPER = 256   # values a superblock of IQ4_XS: d f16, 2 + 4 bytes of 6-bit group scales, 128 of codes
IQ4_XS_BYTES = 136


def pack_iq4_xs_from_gguf(data: GGUFData, shape: Sequence[int]) -> PackedWeight:
    """GGUF IQ4_XS superblocks as iq4_nl tiles. Group j (32 values) of a superblock is d * (ls_j - 32) *
    IQ4_VALUES[code] with a 6-bit ls_j; an iq4_nl group keeps the codes and the float16 of d * (ls_j - 32),
    which float16 holds exactly only when that product has at most 11 significant bits: otherwise it is
    rounded to the nearest (at most 2^-11 of the scale; serving the dense bfloat16 weight instead rounds
    every value by up to 2^-8). ValueError if a scale overflows float16."""
    if len(shape) != 2:
        raise ValueError(f"IQ4_XS: expected a 2-D shape (out, in), got {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if k % IQ4_XS_SUPER:
        raise ValueError(f"IQ4_XS: in_features {k} is not a multiple of {IQ4_XS_SUPER}")
    b = _gguf_raw(data, n * (k // IQ4_XS_SUPER) * IQ4_XS_BYTES, "IQ4_XS", (n, k)).view(-1, IQ4_XS_BYTES)
    d = _f16(b, 0).float()
    high = b[:, 2].int() | (b[:, 3].int() << 8)
    low = b[:, 4:8].int()
    j = torch.arange(8)
    ls = ((low[:, j // 2] >> (4 * (j % 2))) & 0xF) | (((high[:, None] >> (2 * j)) & 3) << 4)
    scales = (d[:, None] * (ls - 32).float()).half()
    _check_scales(scales)
    return _tile_blocks("iq4_nl", k, b[:, 8:].reshape(n, -1, 16), scales.view(n, -1), None)


# ---------------------------------------------------------------- matmul


# the switch lives with the kernel library; re-exported here for callers that know it from quant
DISABLE_ENV = kernels.DISABLE_ENV
refresh_from_env = kernels.refresh_from_env


def kernels_available() -> bool:
    """Whether `quant_linear` runs the C++ kernel on CPU tensors (compiles it on the first call)."""
    return kernels.enabled() and kernels.load() is not None


def quant_linear(x: Tensor, packed: PackedWeight, bias: Tensor | None = None, *, isa: str | None = None) -> Tensor:
    """`x [..., K] @ W^T (+ bias)` in the dtype of `x`. `isa` ("avx512", "avx2", "scalar") forces a
    kernel code path (every one gives the same bits); None runs `kernels.active_isa()`."""
    # the decode hot path: a couple of hundred calls per token, so every check here is a cheap one
    module = kernels.load() if kernels.enabled() else None
    if module is None or not x.is_cpu or not packed.qs.is_cpu or (x.requires_grad and torch.is_grad_enabled()):
        if x.shape[-1] != packed.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight expects {packed.in_features}")
        return _dense_linear(x, packed, bias)
    level = -1 if isa is None else kernels.ISA_LEVELS[isa]
    if packed.kind in K_KINDS:
        return module.qlinear_kquant(x, packed.qs, packed.scales, _KIND_IDS[packed.kind], packed.out_features,
                                     packed.in_features, bias, level, False, packed.float_act)
    if packed.float_act:
        if packed.kind == "iq4_nl":
            raise ValueError("iq4_nl weights multiply with 8-bit activations only: as_q8_0() holds their values "
                             "for float activations")
        return module.qlinear_float(x, packed.qs, packed.scales, _KIND_IDS[packed.kind], packed.out_features,
                                    packed.in_features, bias, level)
    return module.qlinear(x, packed.qs, packed.scales, _KIND_IDS[packed.kind], packed.out_features,
                          packed.in_features, bias, level)


def _dense_linear(x: Tensor, packed: PackedWeight, bias: Tensor | None) -> Tensor:
    # dequantizing per call would cost more than the matmul: keep the dense copy (memory for speed)
    key = (x.dtype, x.device)
    w = packed._dense.get(key)
    if w is None:
        w = packed.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
        packed._dense[key] = w
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def quantize_activations_reference(x: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's activation quantization in torch: `x [M, K]` -> (int8 `[M, G*group]`, scales `[M, G]`,
    scale * group sum `[M, G]`), with q = round-half-even(x * (127 / max|x|)) per group of `group` (32;
    the K-quant kernels quantize per superblock of 256)."""
    xf = x.float()
    m, k = xf.shape
    xg = F.pad(xf, (0, -k % group)).view(m, -1, group)
    amax = xg.abs().amax(-1)
    amax = torch.where(amax >= _TINY_AMAX, amax, torch.zeros_like(amax))
    # tensor / tensor: `127.0 / amax` would compute reciprocal(amax) * 127, rounding twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(_TINY_AMAX), torch.zeros_like(amax))
    q = torch.round(xg * inv[..., None])
    d = amax / 127.0
    s = d * q.sum(-1)
    return q.to(torch.int8).view(m, -1), d, s


def quant_linear_reference(x: Tensor, packed: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """What the kernel computes, in plain torch: int8 activations per group (K-quant weights: per
    superblock of 256) times the dequantized weight, accumulated in float32 (only the summation order
    differs from the kernel)."""
    k, n = packed.in_features, packed.out_features
    lead = x.shape[:-1]
    group = 256 if packed.is_kquant else GROUP
    q, d, _ = quantize_activations_reference(x.reshape(-1, k), group)
    xq = (q.float().view(q.shape[0], -1, group) * d[..., None]).view(q.shape[0], -1)[:, :k]
    y = xq @ packed.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, n)
