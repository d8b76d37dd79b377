"""Dense bfloat16 weights tiled for the C++ dense kernel (kernels/dense_bf16.cpp).

A model served in bfloat16 on the CPU gives each projection and the LM head a tiled twin that the
serving (paged) path multiplies with; training, scoring and the dense path keep `nn.Linear`. torch's
bfloat16 GEMV streams weights at 8-10 GB/s here (a CPU without native bf16 dot products has only
float32 GEMMs, twice the bytes); the kernel reads the bfloat16 tiles once for up to 8 activation rows,
with vdpbf16ps on AVX512-BF16 and widening them in registers on AVX2. Every output is one float32
chain over K in a fixed order, the same bits on every ISA, so a token's result depends neither on the
batch it shares nor on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model import kernels
from kiln.model.precision import compute_dtype, widened_linear
from kiln.model.quant import TILE_ROWS


@dataclass(eq=False)
class DenseTiles:
    tiles: Tensor          # [ceil(N/16), ceil(K/2), 32] bfloat16: tiles[t, p, 2r + e] = W[16t + r, 2p + e]
    out_features: int
    in_features: int


def tile_weight(weight: Tensor) -> DenseTiles:
    """Tile a bfloat16 weight `[N, K]` (zero-padded to whole tiles and K pairs)."""
    n, k = weight.shape
    t, p = -(-n // TILE_ROWS), -(-k // 2)
    w = F.pad(weight.detach().to(torch.bfloat16), (0, 2 * p - k, 0, t * TILE_ROWS - n))
    tiles = w.view(t, TILE_ROWS, p, 2).permute(0, 2, 1, 3).contiguous().view(t, p, 2 * TILE_ROWS)
    return DenseTiles(tiles, n, k)


def attach_dense_tiles(model: nn.Module) -> bool:
    """Give every projection and the LM head of a bfloat16 CPU model its tiles; False when the kernel
    cannot run here (not bfloat16, not CPU, kernels unavailable or disabled)."""
    module = kernels.load() if kernels.enabled() else None
    if module is None:
        return False
    linears = [m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and (name.endswith("_proj") or name == "lm_head")]
    if not linears or any(m.weight.dtype != torch.bfloat16 or not m.weight.is_cpu for m in linears):
        return False
    for m in linears:
        m.dense_tiles = tile_weight(m.weight)
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
        y = widened_linear(x.to(cd), linear.weight, linear.bias)
        return y.float() if out_float else y.to(x.dtype)
    x2 = x.reshape(-1, tiles.in_features)
    y = module.linear_bf16(x2, tiles.tiles, tiles.out_features, tiles.in_features, linear.bias,
                           out_float=out_float)
    return y.view(*x.shape[:-1], tiles.out_features)
