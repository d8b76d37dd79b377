"""Micro-benchmark: a training backward's input gradient `grad @ W` for a K-quant weight held as blocks.

Where training multiplies in float32 (no bf16 dot products: AVX2, or AVX-512 without BF16), Kiln takes
`grad @ W` straight from the tiles (`PackedWeight.input_grad`, kernels/kquant_input_grad.cpp). This
times it against the path it replaced: the weight dequantized to bfloat16, widened to a float32 copy and
multiplied by torch (sgemm), at Llama-3.2-1B's shapes (fused gate|up, down, q|k|v, o, the tied LM head)
for each M (a step's tokens), on torch's threads as training runs it. Wall-clock milliseconds, best of
--reps; random blocks (the speed does not depend on the values).

    .venv/bin/python benchmarks/kquant_input_grad.py [--m 20,60,200] [--threads 2] [--isa avx2]
"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.model import kernels, kquant, precision
from kiln.model.quant import kernels_available
from kiln.testing.kquant_blocks import random_blocks

SHAPES = [("q4_k", 16384, 2048, "gate|up"), ("q6_k", 2048, 8192, "down"), ("q4_k", 3072, 2048, "q|k|v"),
          ("q4_k", 2048, 2048, "o"), ("q6_k", 49152, 2048, "LM head")]


def widened_product(grad: torch.Tensor, pw: kquant.PackedWeight) -> torch.Tensor:
    """What the backward ran before: each panel of rows dequantized to bfloat16 and widened to float32
    in the thread's reused buffers, then sgemm, the panels' products summed."""
    total = None
    for row, part in precision._panels(pw):
        weight = precision._block_weight(part, torch.bfloat16, grad)
        g = precision._input_grad(grad[:, row:row + part.out_features], weight)
        total = g if total is None else total.add_(g)
    return total


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None, help="avx512, avx2 or scalar (default: the CPU's widest)")
    ap.add_argument("--m", default="20,60,200")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not kernels_available():
        raise SystemExit(f"kernels unavailable: {kernels.load_error()}")
    isa = args.isa or kernels.active_isa()
    torch.set_num_threads(args.threads)
    print(f"isa {isa}, {args.threads} threads; ms per product, widened sgemm -> from the tiles (ratio)")
    for kind, n, k, name in SHAPES:
        pw = kquant.pack_from_gguf(kind, random_blocks(kind, n, k, seed=1), (n, k))
        cells = []
        for m in (int(v) for v in args.m.split(",")):
            grad = torch.randn(m, n)
            old = best_ms(lambda g=grad, w=pw: widened_product(g, w), args.reps)
            new = best_ms(lambda g=grad, w=pw: w.input_grad(g, isa=isa), args.reps)
            cells.append(f"M={m}: {old:6.1f} -> {new:6.1f} ({old / new:.2f}x)")
        print(f"{name:8s} {kind} {n}x{k}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
