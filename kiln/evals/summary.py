"""Plain rows summarizing an EvalResult, shared by the CLI tables and the HTML report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.evals.compare import adapter_label


def pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def interval(ci: Mapping[str, Any]) -> str:
    return f"[{pct(ci['lower'])}, {pct(ci['upper'])}]"


def run_row(index: int, run: Mapping[str, Any]) -> dict[str, str]:
    m = run["metrics"]
    return {
        "run": str(index),
        "adapter": adapter_label(run.get("adapter")),
        "n": str(m["num_examples"]),
        "accuracy": pct(m["accuracy"]),
        "95% CI": interval(m["accuracy_confidence_interval"]),
        "mean": f"{m['mean_score']:.3f}",
        "pass/fail/inv/err": f"{m['num_pass']}/{m['num_fail']}/{m['num_invalid']}/{m['num_error']}",
        "p50/p90 ms": f"{m['latency']['p50_ms']:.0f}/{m['latency']['p90_ms']:.0f}",
        "tokens in/out": f"{m['total_prompt_tokens']}/{m['total_completion_tokens']}",
    }


def tag_rows(run: Mapping[str, Any]) -> list[dict[str, str]]:
    out = []
    for tag, b in (run["metrics"].get("tag_breakdown") or {}).items():
        out.append({"tag": tag, "examples": str(b["num_examples"]), "pass": str(b["num_pass"]),
                    "accuracy": pct(b["pass_rate"]), "95% interval": interval(b["confidence_interval"])})
    return out


def scorer_rows(run: Mapping[str, Any]) -> list[dict[str, str]]:
    return [{"scorer": s["scorer_kind"], "examples": str(s["num_examples"]), "accuracy": pct(s["pass_rate"]),
             "mean score": f"{s['mean_score']:.3f}"} for s in run["metrics"].get("by_scorer", [])]


def representative(run: Mapping[str, Any], example_id: str) -> Mapping[str, Any] | None:
    """The raw outcome that stands for an example's aggregated outcome."""
    agg = next((a for a in run["aggregated_outcomes"] if a["example_id"] == example_id), None)
    if agg is None:
        return None
    index = agg["representative_completion_index"]
    return next((o for o in run["outcomes"] if o["example_id"] == example_id and o["completion_index"] == index),
                None)


def example_ids(runs: list[Mapping[str, Any]]) -> list[str]:
    """Every example id across the runs, in first-appearance order."""
    seen: dict[str, None] = {}
    for run in runs:
        for a in run["aggregated_outcomes"]:
            seen.setdefault(a["example_id"], None)
    return list(seen)
