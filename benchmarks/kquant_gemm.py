"""Micro-benchmark: one K-quant linear layer at prompt-processing sizes (M > 8 rows, the GEMM).

Kiln's kernel with 8-bit activations (llama.cpp's arithmetic: `quant_linear` on a Q4_K or Q6_K weight
with `float_act = False`) at Llama-3.2-1B's FFN shapes, N x K = 8192 x 2048 (gate/up) and 2048 x 8192
(down), for each M and thread count, in GOP/s (2 * M * N * K per call) of that many cores. Random
blocks: the speed does not depend on the values.

    .venv/bin/python benchmarks/kquant_gemm.py [--isa avx512] [--m 32,128,500] [--threads 1,2]

On a shared machine wall-clock figures measure the other jobs as much as the kernel: with one thread the
time is this thread's CPU time (the kernel runs on the calling thread), with more it is the process's
CPU time divided by the threads, as if each had a core of its own (the pool's threads spin while they wait
for work or for each other, so an imbalance between them lowers it as it lowers the wall-clock figure on
an idle machine). The best of --reps repetitions is the figure to compare.
"""

from __future__ import annotations

import argparse
import time

import torch

from kiln.model import kernels, kquant
from kiln.model.quant import PackedWeight, kernels_available, quant_linear
from kiln.testing.kquant_blocks import random_blocks

SHAPES = [(8192, 2048), (2048, 8192)]


def weight(kind: str, n: int, k: int) -> PackedWeight:
    pw = kquant.pack_from_gguf(kind, random_blocks(kind, n, k, seed=1), (n, k))
    pw.float_act = False
    return pw


def gops(x: torch.Tensor, pw: PackedWeight, isa: str, threads: int, reps: int) -> float:
    m, k = x.shape
    calls = max(1, int(2e9 / (m * pw.out_features * k)))
    clock = time.thread_time if threads == 1 else time.process_time
    quant_linear(x, pw, isa=isa)
    best = float("inf")
    for _ in range(reps):
        start = clock()
        for _ in range(calls):
            quant_linear(x, pw, isa=isa)
        best = min(best, (clock() - start) / (calls * threads))
    return 2 * m * pw.out_features * k / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None, help="avx512, avx2 or scalar (default: the CPU's widest)")
    ap.add_argument("--kinds", default="q4_k,q6_k")
    ap.add_argument("--m", default="32,128,500")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not kernels_available():
        raise SystemExit(f"kernels unavailable: {kernels.load_error()}")
    isa = args.isa or kernels.active_isa()
    ms = [int(v) for v in args.m.split(",")]
    print(f"isa {isa}; GOP/s of `threads` cores (2*M*N*K per call over CPU time / threads)")
    for kind in args.kinds.split(","):
        for n, k in SHAPES:
            pw = weight(kind, n, k)
            for threads in (int(v) for v in args.threads.split(",")):
                torch.set_num_threads(threads)
                cells = [f"M={m}: {gops(torch.randn(m, k, dtype=torch.bfloat16), pw, isa, threads, args.reps):6.1f}"
                         for m in ms]
                print(f"{kind} {n}x{k} threads={threads}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
