"""Dense bfloat16 weights tiled for the C++ dense kernel (kernels/dense_bf16.cpp).

A model served in bfloat16 on the CPU gives each projection and the LM head a tiled twin that the
serving (paged) path multiplies with; training, scoring and the dense path keep `nn.Linear`. torch's
bfloat16 GEMV streams weights at 8-10 GB/s here (a CPU without native bf16 dot products has only
float32 GEMMs, twice the bytes); the kernel reads the bfloat16 tiles once for up to 8 activation rows,
with vdpbf16ps on AVX512-BF16 and widening them in registers on AVX2. Every output is one float32
chain over K in a fixed order, the same bits on every ISA, so a token's result depends neither on the
batch it shares nor on the CPU.

On AVX512-BF16, a weight that is a GGUF's Q4_0 / Q4_1 / Q8_0 blocks dequantized (the embedded
SmolLM2 is Q4_1 and Q8_0) also keeps its codes (`code_weight`): for up to `CODED_MAX_ROWS` activation
rows (decode steps) the kernel rebuilds every bfloat16 value exactly in registers and multiplies as
before, so the same bits from a third of the bytes; more rows (prefill) read the bfloat16 tiles, where
rebuilding would cost more than the bytes it saves. `attach_dense_tiles` checks each coded weight
against its tiles before it serves. On AVX2 the rebuilding (no bf16 conversion instruction) costs more
than streaming bfloat16, so there the tiles serve alone (measured on a 2-core Intel Xeon, a whole
model's one-row decode GEMVs: AVX2 11.6-13.8 ms from tiles, 12.6-14.9 ms from codes; AVX512-BF16
10.1-11.5 ms from tiles, 8.5-9.3 ms from codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model import kernels
from kiln.model.precision import compute_dtype, mixed_linear
from kiln.model.quant import GROUP, TILE_ROWS, PackedWeight, QuantCodes

# activation rows up to which a coded weight multiplies from its codes (the kernel's widest row block)
CODED_MAX_ROWS = 8


@dataclass(eq=False)
class DenseTiles:
    # [ceil(N/16), ceil(K/2), 32] bfloat16: tiles[t, p, 2r + e] = W[16t + r, 2p + e]
    tiles: Tensor
    out_features: int
    in_features: int
    # the same values as codes (kernels/dense_bf16.cpp's layout): kind 0 4-bit with d and m, 1 int8 with d
    codes: Tensor | None = None
    scales: Tensor | None = None
    code_kind: int = 0

    @property
    def coded(self) -> bool:
        return self.codes is not None



def tile_weight(weight: Tensor) -> DenseTiles:
    """Tile a bfloat16 weight `[N, K]` (zero-padded to whole tiles and K pairs)."""
    n, k = weight.shape
    t, p = -(-n // TILE_ROWS), -(-k // 2)
    w = F.pad(weight.detach().to(torch.bfloat16), (0, 2 * p - k, 0, t * TILE_ROWS - n))
    tiles = w.view(t, TILE_ROWS, p, 2).permute(0, 2, 1, 3).contiguous().view(t, p, 2 * TILE_ROWS)
    return DenseTiles(tiles, n, k)


def code_weight(codes: QuantCodes) -> tuple[Tensor, Tensor, int]:
    """(codes, scales, kind) of a weight's GGUF codes in the coded layout of kernels/dense_bf16.cpp
    (rows past N: codes 0, d = m = 0)."""
    n, k = codes.q.shape
    t, g = -(-n // TILE_ROWS), k // GROUP
    pad = t * TILE_ROWS - n
    q = F.pad(codes.q.view(torch.uint8), (0, 0, 0, pad)).view(t, TILE_ROWS, g, 16, 2)
    d = F.pad(codes.d, (0, 0, 0, pad)).view(t, TILE_ROWS, g).permute(0, 2, 1)
    if codes.kind == "q4_1":
        q = q.permute(0, 2, 3, 1, 4)                           # [t, g, pair, r, e]
        packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()   # [t, g, 16, 16]
        m = F.pad(codes.m, (0, 0, 0, pad)).view(t, TILE_ROWS, g).permute(0, 2, 1)
        scales = torch.cat([d, m], dim=-1).contiguous()
        return packed, scales, 0
    packed = q.permute(0, 2, 3, 4, 1).reshape(t, g, 16, 2 * TILE_ROWS).contiguous()   # [t, g, pair, e*16 + r]
    return packed, d.contiguous(), 1


def codes_serve_here() -> bool:
    """Whether a coded weight's decode rows multiply from its codes here: on AVX512-BF16 only."""
    module = kernels.load() if kernels.enabled() else None
    return module is not None and kernels.active_isa() == "avx512" and module.bf16_dot_supported()


def attach_dense_tiles(model: nn.Module, packed: dict[str, PackedWeight] | None = None) -> bool:
    """Give every projection and the LM head of a bfloat16 CPU model its tiles; False when the kernel
    cannot run here (not bfloat16, not CPU, kernels unavailable or disabled). With `packed` (HF weight
    name -> the GGUF's blocks), a weight whose codes rebuild its bfloat16 values exactly keeps the codes."""
    module = kernels.load() if kernels.enabled() else None
    if module is None:
        return False
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and (name.endswith("_proj") or name == "lm_head")]
    if not linears or any(m.weight.dtype != torch.bfloat16 or not m.weight.is_cpu for _, m in linears):
        return False
    use_codes = bool(packed) and codes_serve_here()
    for name, m in linears:
        m.dense_tiles = tile_weight(m.weight)
        pw = packed.get(f"{name}.weight") if use_codes and packed else None
        # (K-quant blocks have no 4/8-bit codes of the dense kernel: their tiles serve dense)
        if (pw is not None and not pw.is_kquant and pw.in_features % GROUP == 0
                and pw.out_features == m.dense_tiles.out_features):
            codes, scales, kind = code_weight(pw.codes())
            decoded = module.decode_coded_tiles(codes, scales, kind, pw.out_features, pw.in_features)
            if torch.equal(decoded.view(torch.int16), m.dense_tiles.tiles.view(torch.int16)):
                m.dense_tiles.codes, m.dense_tiles.scales, m.dense_tiles.code_kind = codes, scales, kind
    return True


def dense_linear(x: Tensor, linear: nn.Linear, out_float: bool = False) -> Tensor:
    """`linear(x)` through the kernel when `linear` has tiles and `x` is bfloat16 on the CPU outside
    autograd. `out_float`: float32 sums, not rounded to bfloat16 (logits)."""
    tiles: DenseTiles | None = getattr(linear, "dense_tiles", None)
    module = kernels.for_tensor(x) if tiles is not None and x.dtype == torch.bfloat16 else None
    if module is None:
        cd = compute_dtype(linear.weight.dtype, x.device)
        if cd == x.dtype:
            return linear(x).float() if out_float else linear(x)
        # no kernel (disabled, still building): torch's float32 GEMM, not its emulated bfloat16 one
        y = mixed_linear(x.to(cd), linear.weight, linear.bias)
        return y.float() if out_float else y.to(x.dtype)
    return tiles_linear(module, x, tiles, linear.bias, out_float)


def tiles_linear(module, x: Tensor, tiles: DenseTiles, bias: Tensor | None, out_float: bool = False) -> Tensor:
    """`x @ W^T (+ bias)` through the kernel `module` for bfloat16 `x` on the CPU: from the codes for
    decode-sized batches of a coded weight, else from the tiles (the same bits either way)."""
    x2 = x.reshape(-1, tiles.in_features)
    if tiles.coded and x2.shape[0] <= CODED_MAX_ROWS:
        y = module.linear_bf16_coded(x2, tiles.codes, tiles.scales, tiles.code_kind, tiles.out_features,
                                     tiles.in_features, bias, out_float=out_float)
    else:
        y = module.linear_bf16(x2, tiles.tiles, tiles.out_features, tiles.in_features, bias, out_float=out_float)
    return y.view(*x.shape[:-1], tiles.out_features)
