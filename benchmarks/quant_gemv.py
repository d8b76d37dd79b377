"""Micro-benchmark: one full-model pass of SmolLM2-135M's linear layers at decode sizes.

30 layers x [q 576x576, k 192x576, v 192x576, o 576x576, gate 1536x576, up 1536x576, down 576x1536]
plus the tied head 49152x576, timed as one pass (the same input for every matrix: this measures the
GEMVs, not the model). Engines: Kiln's kernel on q4_1 layers + q8_0 head (one call per matrix, and
fused q/k/v and gate+up), torch bf16 `F.linear`, and torch's int4pack (group 32) CPU kernel.
Weights are random; the kernel's speed does not depend on their values.

    .venv/bin/python benchmarks/quant_gemv.py [--reps 30] [--threads 1,2] [--m 1,8]

Other jobs on the machine slow every figure down: the minimum over repetitions is the figure to
compare, the median shows the noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.model import kernels
from kiln.model.quant import concat_packed, kernels_available, pack_q4_1, pack_q8_0, quant_linear

HIDDEN, KV, INTER, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
LAYER = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
         "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}

Pass = Callable[[dict[int, torch.Tensor]], None]


def random_weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k) * 0.05


def kiln_engines() -> dict[str, tuple[Pass, int]]:
    layers = [{name: pack_q4_1(random_weight(*shape)) for name, shape in LAYER.items()} for _ in range(LAYERS)]
    head = pack_q8_0(random_weight(VOCAB, HIDDEN))
    fused = [
        {"qkv": concat_packed([p["q"], p["k"], p["v"]]), "o": p["o"],
         "gate_up": concat_packed([p["gate"], p["up"]]), "down": p["down"]}
        for p in layers
    ]

    def unfused(x: dict[int, torch.Tensor]) -> None:
        for p in layers:
            for w in p.values():
                quant_linear(x[w.in_features], w)
        quant_linear(x[HIDDEN], head)

    def fused_pass(x: dict[int, torch.Tensor]) -> None:
        for p in fused:
            for w in p.values():
                quant_linear(x[w.in_features], w)
        quant_linear(x[HIDDEN], head)

    nbytes = sum(w.nbytes for p in layers for w in p.values()) + head.nbytes
    return {"kiln q4_1 + q8_0 head, 7 calls/layer": (unfused, nbytes),
            "kiln q4_1 + q8_0 head, fused qkv + gate_up": (fused_pass, nbytes)}


def torch_bf16_engine() -> dict[str, tuple[Pass, int]]:
    weights = [random_weight(*shape).bfloat16() for _ in range(LAYERS) for shape in LAYER.values()]
    weights.append(random_weight(VOCAB, HIDDEN).bfloat16())

    def run(x: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(x[w.shape[1]], w)

    return {"torch bf16 F.linear": (run, sum(w.nbytes for w in weights))}


def int4pack(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + scale * 8   # the kernel computes (q - 8) * scale + zero
    sz = torch.stack([scale.view(n, -1), zero.view(n, -1)], -1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def torch_int4_engine() -> dict[str, tuple[Pass, int]]:
    shapes = [shape for _ in range(LAYERS) for shape in LAYER.values()] + [(VOCAB, HIDDEN)]
    packed = [(shape[1], *int4pack(random_weight(*shape))) for shape in shapes]

    def run(x: dict[int, torch.Tensor]) -> None:
        for k, w, sz in packed:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x[k], w, 32, sz)

    return {"torch int4pack (bf16 x)": (run, sum(w.nbytes + sz.nbytes for _, w, sz in packed))}


def time_pass(run: Pass, x: dict[int, torch.Tensor], reps: int) -> tuple[float, float]:
    for _ in range(3):
        run(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--m", default="1,8")
    parser.add_argument("--skip-torch", action="store_true", help="only Kiln's kernel")
    args = parser.parse_args()
    torch.manual_seed(0)
    if not kernels_available():
        raise SystemExit(f"kernels unavailable: {kernels.load_error()}")
    print(f"kernel path: {kernels.best_isa()}")
    engines = kiln_engines()
    if not args.skip_torch:
        engines |= torch_bf16_engine() | torch_int4_engine()
    print(f"{'engine':48} {'M':>3} {'thr':>3} {'min ms':>8} {'median':>8} {'GB/s':>6}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for m in (int(v) for v in args.m.split(",")):
            for name, (run, nbytes) in engines.items():
                dtype = torch.float32 if name.startswith("kiln") else torch.bfloat16
                x = {k: torch.randn(m, k, dtype=dtype) for k in (HIDDEN, INTER)}
                best, median = time_pass(run, x, args.reps)
                print(f"{name:48} {m:>3} {threads:>3} {best:8.2f} {median:8.2f} {nbytes / best / 1e6:6.1f}")


if __name__ == "__main__":
    main()
