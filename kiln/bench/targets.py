"""The performance targets Kiln is held to, checked against a finished `BenchResult`.

Targets against llama-server are per comparison (one per ISA and Kiln weight format): the default
weights (`kiln serve` as `make serve` starts it) must at least match llama-server's single-stream
decode; the GGUF's own blocks (`--quantization gguf`, what llama-server runs) must beat it by the
margins below. Kiln's own figures (ITL spread and worst gap while a long prompt arrives, the
learning loop, adapters, ITL while training) are checked for every Kiln engine that measured them.

A real-size model (at least `REAL_SIZE_PARAMETERS` weights: the 1-8B GGUFs users serve) is held to
the real-size targets instead, where memory bandwidth binds a single stream and llama-server sits at
the floor: decode at least llama-server's with either weights, prefill 2x, 8 streams 2x, 32 and 64 3x,
no gap over 300 ms while a long prompt arrives, and the learning loop within 30 s up to
`LEARNING_LOOP_MAX_PARAMETERS` (a 1B model; none is set for bigger ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.bench.results import KILN, BenchResult, Comparison
from kiln.bench.stats import format_ratio

MET, MISSED, NOT_MEASURED = "met", "missed", "n/a"

MAX_ITL_GAP_MS = 250.0
LEARNING_LOOP_S = {"avx512": 10.0, "avx2": 12.0}   # other ISAs: the AVX2 bound
REAL_SIZE_PARAMETERS = 500_000_000
REAL_SIZE_MAX_ITL_GAP_MS = 300.0
REAL_SIZE_LEARNING_LOOP_S = 30.0
LEARNING_LOOP_MAX_PARAMETERS = 1_500_000_000


def real_size(result: BenchResult) -> bool:
    return (result.model_parameters or 0) >= REAL_SIZE_PARAMETERS


def targets_title(result: BenchResult) -> str:
    """Which set of targets applies, for the report's heading."""
    if real_size(result):
        return "Targets (a real-size model: at least 0.5B parameters)"
    return "Targets"


@dataclass(frozen=True)
class TargetOutcome:
    status: str          # met | missed | n/a
    measured: str        # what was measured, human-readable


@dataclass(frozen=True)
class Target:
    name: str
    requirement: str
    check: Callable[[BenchResult], TargetOutcome]


def _keys_with_prefix(result: BenchResult, prefix: str) -> list[str]:
    return [r.spec.key for r in result.rows if r.spec.key.startswith(prefix)]


def _prompt_len(key: str) -> int:
    return int(key.rsplit("@", 1)[1])


def _longest_prefill(result: BenchResult) -> list[str]:
    keys = _keys_with_prefix(result, "single.prefill_tps@")
    return [max(keys, key=_prompt_len)] if keys else []


def versus(comparison: Comparison, keys: Callable[[BenchResult], list[str]], threshold: float
           ) -> Callable[[BenchResult], TargetOutcome]:
    """Met when the comparison's Kiln engine is at least `threshold` times better than its reference
    on every row in `keys`."""
    def check(result: BenchResult) -> TargetOutcome:
        parts, ratios = [], []
        for key in keys(result):
            row = result.row(key)
            ratio = None if row is None else row.ratio(comparison)
            if row is not None and ratio is not None:
                ratios.append(ratio)
                parts.append(f"{format_ratio(ratio)} ({row.spec.label})")
        if not ratios:
            return TargetOutcome(NOT_MEASURED, f"needs {comparison.kiln} and {comparison.reference} figures")
        return TargetOutcome(MET if min(ratios) >= threshold else MISSED, "; ".join(parts))
    return check


def engine_value(engine: str, key: str, threshold: float, at_most: bool, describe: Callable[[float], str]
                 ) -> Callable[[BenchResult], TargetOutcome]:
    """Met when `engine`'s own figure `key` is within `threshold` (a ratio inside one run, or seconds)."""
    def check(result: BenchResult) -> TargetOutcome:
        value = result.value(key, engine)
        if value is None:
            return TargetOutcome(NOT_MEASURED, f"needs {key}")
        ok = value <= threshold if at_most else value >= threshold
        return TargetOutcome(MET if ok else MISSED, describe(value))
    return check


def itl_arrival(engine: str, max_gap_ms: float = MAX_ITL_GAP_MS) -> Callable[[BenchResult], TargetOutcome]:
    def check(result: BenchResult) -> TargetOutcome:
        spread = result.value("itl.p99_over_p50", engine)
        worst = result.value("itl.max_gap_ms", engine)
        if spread is None or worst is None:
            return TargetOutcome(NOT_MEASURED, "needs the itl measurement")
        p50, p99 = result.value("itl.p50_ms", engine), result.value("itl.p99_ms", engine)
        ok = spread <= 3.0 and worst <= max_gap_ms
        return TargetOutcome(MET if ok else MISSED,
                             f"p99 {p99:.1f} ms / p50 {p50:.1f} ms = {spread:.2f}x; max gap {worst:.0f} ms")
    return check


def _comparison_targets(c: Comparison, real: bool) -> list[Target]:
    where = f"{c.kiln} vs {c.reference}"
    decode_bound = 1.0 if c.weights == "default" or real else 1.5
    prefill_bound = 2.0 if real else 2.5
    decode = versus(c, lambda r: _keys_with_prefix(r, "single.decode_tps@"), decode_bound)
    if c.weights == "default":
        return [Target(f"single-stream decode, default weights ({c.isa})", f">= 1.0x llama-server, every prompt "
                       f"length ({where})", decode)]
    if c.weights != "gguf":
        return []
    return [
        Target(f"single-stream decode, gguf ({c.isa})", f">= {decode_bound:g}x llama-server, every prompt length "
               f"({where})", decode),
        Target(f"prefill, gguf ({c.isa})", f">= {prefill_bound:g}x llama-server, longest prompt ({where})",
               versus(c, _longest_prefill, prefill_bound)),
        Target(f"aggregate throughput, 8 streams, gguf ({c.isa})", f">= 2x llama-server ({where})",
               versus(c, lambda r: ["concurrent.agg_tps@8"], 2.0)),
        Target(f"aggregate throughput, 32 and 64 streams, gguf ({c.isa})", f">= 3x llama-server ({where})",
               versus(c, lambda r: [k for k in ("concurrent.agg_tps@32", "concurrent.agg_tps@64")
                                    if r.row(k) is not None], 3.0)),
    ]


def _kiln_engines(result: BenchResult) -> list[str]:
    return [e for e in result.engines() if e.startswith(KILN)]


def _isa_of(result: BenchResult, engine: str) -> str:
    return next((c.isa for c in result.comparisons if c.kiln == engine), engine.rsplit(" ", 1)[-1])


def targets_for(result: BenchResult) -> list[Target]:
    """Every target that applies to what this run measured."""
    real = real_size(result)
    max_gap = REAL_SIZE_MAX_ITL_GAP_MS if real else MAX_ITL_GAP_MS
    out = [t for c in result.comparisons for t in _comparison_targets(c, real)]
    for engine in _kiln_engines(result):
        if result.value("itl.p99_over_p50", engine) is not None:
            out.append(Target(f"ITL during a long-prompt arrival ({engine})",
                              f"p99 <= 3x p50 and max gap <= {max_gap:.0f} ms", itl_arrival(engine, max_gap)))
        if result.value("adapters.mixed_over_base", engine) is not None:
            out.append(Target(f"streams over 4 adapters ({engine})", ">= 0.7x the same streams on the base model",
                              engine_value(engine, "adapters.mixed_over_base", 0.7, False, lambda v: f"{v:.2f}x")))
        if result.value("training.learning_loop_s", engine) is not None and (
                not real or (result.model_parameters or 0) <= LEARNING_LOOP_MAX_PARAMETERS):
            bound = (REAL_SIZE_LEARNING_LOOP_S if real
                     else LEARNING_LOOP_S.get(_isa_of(result, engine), LEARNING_LOOP_S["avx2"]))
            out.append(Target(f"learning loop ({engine})", f"<= {bound:.0f} s from the SFT POST to the first "
                              "correct answer", engine_value(engine, "training.learning_loop_s", bound, True,
                                                              lambda v: f"{v:.1f} s")))
        if result.value("training.itl_p99_ratio", engine) is not None:
            out.append(Target(f"ITL p99 while training ({engine})", "<= 5x the same streams without training",
                              engine_value(engine, "training.itl_p99_ratio", 5.0, True, lambda v: f"{v:.2f}x")))
    return out


def evaluate_targets(result: BenchResult) -> list[tuple[Target, TargetOutcome]]:
    return [(t, t.check(result)) for t in targets_for(result)]
