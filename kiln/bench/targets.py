"""The performance targets Kiln is held to, checked against a finished `BenchResult`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.bench.results import KILN, LLAMACPP, BenchResult
from kiln.bench.stats import format_ratio, speedup

MET, MISSED, NOT_MEASURED = "met", "missed", "n/a"


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


def versus_llamacpp(keys: Callable[[BenchResult], list[str]], threshold: float) -> Callable[[BenchResult], TargetOutcome]:
    """Met when Kiln is at least `threshold` times better than llama.cpp on every row in `keys`."""
    def check(result: BenchResult) -> TargetOutcome:
        parts, ratios = [], []
        for key in keys(result):
            row = result.row(key)
            if row is None:
                continue
            ratio = speedup(row.values.get(KILN), row.values.get(LLAMACPP), row.spec.higher_is_better)
            if ratio is not None:
                ratios.append(ratio)
                parts.append(f"{format_ratio(ratio)} ({row.spec.label})")
        if not ratios:
            return TargetOutcome(NOT_MEASURED, "needs Kiln and llama.cpp figures")
        return TargetOutcome(MET if min(ratios) >= threshold else MISSED, "; ".join(parts))
    return check


def itl_spread(threshold: float) -> Callable[[BenchResult], TargetOutcome]:
    def check(result: BenchResult) -> TargetOutcome:
        spread = result.value("itl.p99_over_p50", KILN)
        if spread is None:
            return TargetOutcome(NOT_MEASURED, "needs the itl measurement")
        p50, p99 = result.value("itl.p50_ms", KILN), result.value("itl.p99_ms", KILN)
        return TargetOutcome(MET if spread <= threshold else MISSED,
                             f"p99 {p99:.1f} ms / p50 {p50:.1f} ms = {spread:.2f}x")
    return check


def _longest_prefill(result: BenchResult) -> list[str]:
    keys = _keys_with_prefix(result, "single.prefill_tps@")
    return [max(keys, key=_prompt_len)] if keys else []


def kiln_value(key: str, threshold: float, at_most: bool, describe: Callable[[float], str]
               ) -> Callable[[BenchResult], TargetOutcome]:
    """Met when Kiln's own figure `key` is within `threshold` (a ratio inside one run, or seconds)."""
    def check(result: BenchResult) -> TargetOutcome:
        value = result.value(key, KILN)
        if value is None:
            return TargetOutcome(NOT_MEASURED, f"needs {key}")
        ok = value <= threshold if at_most else value >= threshold
        return TargetOutcome(MET if ok else MISSED, describe(value))
    return check


TARGETS: list[Target] = [
    Target("single-stream decode", ">= 1.0x llama.cpp (every prompt length)",
           versus_llamacpp(lambda r: _keys_with_prefix(r, "single.decode_tps@"), 1.0)),
    Target("prefill", ">= 3x llama.cpp (longest single-stream prompt)", versus_llamacpp(_longest_prefill, 3.0)),
    Target("aggregate throughput, 8 streams", ">= 5x llama.cpp's server",
           versus_llamacpp(lambda r: ["concurrent.agg_tps@8"], 5.0)),
    Target("ITL p99 during a long-prompt arrival", "<= 3x the median ITL", itl_spread(3.0)),
    Target("streams over 4 adapters", ">= 0.7x the same streams on the base model (same run)",
           kiln_value("adapters.mixed_over_base", 0.7, False, lambda v: f"{v:.2f}x")),
    Target("learning loop", "<= 30 s from the SFT POST to the first correct answer (default model)",
           kiln_value("training.learning_loop_s", 30.0, True, lambda v: f"{v:.1f} s")),
    Target("ITL p99 while training", "<= 5x the same streams without training",
           kiln_value("training.itl_p99_ratio", 5.0, True, lambda v: f"{v:.2f}x")),
]


def evaluate_targets(result: BenchResult) -> list[tuple[Target, TargetOutcome]]:
    return [(t, t.check(result)) for t in TARGETS]
