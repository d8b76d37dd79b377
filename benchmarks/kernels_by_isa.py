"""Micro-benchmark: one decode step of the embedded SmolLM2-135M on every ISA the CPU runs.

For each weight format (dense bfloat16, `kiln serve`'s default; the GGUF's own Q4_1/Q8_0 blocks) it
prefills ~N-token sequences, then times single-sequence decode steps (model forward through the
DecodeStack + LM head, no HTTP, no sampling) with the kernels forced to each ISA in turn, the ISAs
interleaved step by step so that other load on the machine hits them alike.

    .venv/bin/python benchmarks/kernels_by_isa.py [--context 100,500] [--steps 40] [--batch 1]

The minimum over steps is the figure to compare (noise only ever adds time); the median shows the
noise. The last column is each ISA's time relative to the fastest.
"""

from __future__ import annotations

# kiln before torch: the process settings kiln/__init__.py makes (as the server has them)
import kiln  # noqa: F401

# isort: split
import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kiln.model import kernels
from kiln.model import transformer as transformer_module
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import default_model_path, load_model
from kiln.model.transformer import Transformer

BLOCK = 16


def _step_fn(model: Transformer, context: int, batch: int) -> Callable[[], None]:
    """A closure running one decode step of `batch` sequences that each hold `context` tokens (the
    step writes its K/V at position `context` every time, so repeating it never grows the context)."""
    blocks = -(-(context + 1) // BLOCK)
    cache = KVCache(model.config, blocks * batch + 1, BLOCK, model.dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(1 + b * blocks, 1 + (b + 1) * blocks)) for b in range(batch)]
    ids = [torch.randint(0, model.config.vocab_size, (context + 1,), generator=gen).tolist() for _ in range(batch)]
    with torch.inference_mode():
        for table, seq in zip(tables, ids, strict=True):
            meta, pos = build_attention_metadata([(table, 0, context)], BLOCK, "cpu")
            model(torch.tensor(seq[:context]), torch.tensor(pos), meta, cache)
    meta, pos = build_attention_metadata([(t, context, 1) for t in tables], BLOCK, "cpu")
    tokens = torch.tensor([seq[context] for seq in ids])
    positions = torch.tensor(pos)

    def step() -> None:
        with torch.inference_mode():
            hidden = model(tokens, positions, meta, cache)
            model.compute_logits(hidden, packed_ok=True)

    return step


def _time(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()   # warm-up
    for _ in range(reps):
        for name, fn in fns.items():
            isa = name.split()[-1]
            with kernels.using_isa(isa):
                t0 = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - t0)
    return out


def _report(title: str, times: dict[str, list[float]], per_token: int = 1) -> None:
    best = min(min(v) for v in times.values())
    print(f"\n{title}")
    for name, v in times.items():
        lo, med = min(v), statistics.median(v)
        print(f"  {name:<28} min {lo * 1e3:8.2f} ms  median {med * 1e3:8.2f} ms  "
              f"{per_token / lo:8.1f} tok/s  x{lo / best:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="100,500")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--formats", default="none,gguf")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.load() is None:
        raise SystemExit(f"kernels unavailable: {kernels.load_error()}")
    isas = [i for i in reversed(kernels.cpu_isas()) if i != "scalar"] or ["scalar"]
    print(f"CPU ISAs: {', '.join(kernels.cpu_isas())}; timing {', '.join(isas)}; threads {torch.get_num_threads()}")
    path = default_model_path()
    for fmt in args.formats.split(","):
        model, _ = load_model(path, dtype="auto" if fmt == "gguf-float" else "bfloat16", quantization=fmt)
        transformer_module.use_decode_stack = True
        for context in (int(c) for c in args.context.split(",")):
            step = _step_fn(model, context, args.batch)
            times = _time({f"{fmt} {isa}": step for isa in isas}, args.steps)
            _report(f"{fmt}: decode step, {args.batch} sequence(s) at context {context}", times, args.batch)


if __name__ == "__main__":
    main()
