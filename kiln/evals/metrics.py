"""AggregateMetrics (semantics.md §8.7): accuracy and breakdowns over aggregated outcomes; latency,
tokens, reasoning and tool-format counts over raw outcomes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.core.tool_calls import extract_tool_calls
from kiln.evals.aggregate import AggregatedOutcome
from kiln.evals.outcome import ExampleOutcome
from kiln.evals.scorers import tool_call
from kiln.evals.scorers.all_of import AllSpec
from kiln.evals.scorers.any_of import AnySpec
from kiln.evals.scorers.base import ERROR, FAIL, INVALID, PASS
from kiln.evals.stats import value_at_rounded_rank, wilson_interval

U64_MAX = (1 << 64) - 1
NO_TOOL = "<none>"


@dataclass(frozen=True)
class ExampleInfo:
    """What metrics need to know about an example beyond its outcomes."""

    weight: float = 1.0
    scorer_kind: str = "unknown"
    target_tool: str | None = None  # first target tool name, for tool_call-scored examples


def example_info(example: Any) -> ExampleInfo:
    """From a ResolvedExample (anything with weight, scorer, target)."""
    return ExampleInfo(weight=example.weight, scorer_kind=example.scorer.kind,
                       target_tool=_target_tool(example.scorer, example.target))


def _uses_tool_call(spec: Any) -> bool:
    if isinstance(spec, tool_call.ToolCallSpec):
        return True
    return isinstance(spec, AllSpec | AnySpec) and any(_uses_tool_call(s) for s in spec.scorers)


def _target_tool(spec: Any, target: str | None) -> str | None:
    if target is None or not _uses_tool_call(spec):
        return None
    calls = extract_tool_calls(target)
    return calls[0].name if calls else None


def latency_stats(values: Sequence[float]) -> dict[str, float]:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0}
    return {
        "p50_ms": value_at_rounded_rank(finite, 0.50),
        "p90_ms": value_at_rounded_rank(finite, 0.90),
        "p99_ms": value_at_rounded_rank(finite, 0.99),
        "mean_ms": sum(finite) / len(finite),
        "max_ms": finite[-1],
    }


def reasoning_length_stats(raw: Sequence[ExampleOutcome]) -> dict[str, Any]:
    lengths = sorted(len(o.reasoning_text) for o in raw if o.reasoning_text is not None)
    if not lengths:
        return {"num_with_thinking": 0, "mean_chars": 0.0, "p50_chars": 0, "p90_chars": 0, "max_chars": 0}
    return {
        "num_with_thinking": len(lengths),
        "mean_chars": sum(lengths) / len(lengths),
        "p50_chars": int(value_at_rounded_rank(lengths, 0.50)),
        "p90_chars": int(value_at_rounded_rank(lengths, 0.90)),
        "max_chars": lengths[-1],
    }


def _rate_breakdown(num_pass: int, n: int) -> dict[str, Any]:
    return {"num_examples": n, "num_pass": num_pass, "pass_rate": num_pass / n if n else 0.0,
            "confidence_interval": wilson_interval(num_pass, n).to_dict()}


def _is_non_xml(detail: str) -> bool:
    return "formats=" in detail and "formats=[xml" not in detail


def compute_metrics(
    aggregated: Sequence[AggregatedOutcome],
    raw: Sequence[ExampleOutcome],
    examples: Mapping[str, ExampleInfo],
    *,
    elapsed_secs: float,
) -> dict[str, Any]:
    """`examples` maps example id to its ExampleInfo (see `example_info`); missing ids get defaults."""
    n = len(aggregated)
    info = {a.example_id: examples.get(a.example_id, ExampleInfo()) for a in aggregated}
    num_pass = sum(1 for a in aggregated if a.kind == PASS)
    total_w = sum(info[a.example_id].weight for a in aggregated)
    weighted = sum(a.score * info[a.example_id].weight for a in aggregated) / total_w if total_w > 0 else 0.0

    tag_counts: dict[str, list[int]] = {}
    for a in aggregated:
        for tag in dict.fromkeys(a.tags):
            counts = tag_counts.setdefault(tag, [0, 0])
            counts[0] += a.kind == PASS
            counts[1] += 1
    tag_breakdown = {t: _rate_breakdown(p, c) for t, (p, c) in sorted(tag_counts.items())}

    scorer_rows: dict[str, list[float]] = {}
    for a in aggregated:
        row = scorer_rows.setdefault(info[a.example_id].scorer_kind, [0, 0.0, 0])
        row[0] += 1
        row[1] += a.score
        row[2] += a.kind == PASS
    by_scorer = [
        {"scorer_kind": kind, "num_examples": int(c), "mean_score": s / c, "pass_rate": p / c}
        for kind, (c, s, p) in sorted(scorer_rows.items())
    ]

    raw_by_key = {(o.example_id, o.completion_index): o for o in raw}
    tool_counts: dict[str, list[int]] = {}
    confusion: dict[str, dict[str, int]] = {}
    for a in aggregated:
        target = info[a.example_id].target_tool
        if target is None:
            continue
        counts = tool_counts.setdefault(target, [0, 0])
        counts[0] += a.kind == PASS
        counts[1] += 1
        rep = raw_by_key.get((a.example_id, a.representative_completion_index))
        predicted = rep.predicted_tools[0] if rep is not None and rep.predicted_tools else NO_TOOL
        row = confusion.setdefault(target, {})
        row[predicted] = row.get(predicted, 0) + 1

    metrics: dict[str, Any] = {
        "num_examples": n,
        "num_completions": len(raw),
        "num_pass": num_pass,
        "num_fail": sum(1 for a in aggregated if a.kind == FAIL),
        "num_invalid": sum(1 for a in aggregated if a.kind == INVALID),
        "num_error": sum(1 for a in aggregated if a.kind == ERROR),
        "accuracy": num_pass / n if n else 0.0,
        "accuracy_confidence_interval": wilson_interval(num_pass, n).to_dict(),
        "mean_score": sum(a.score for a in aggregated) / n if n else 0.0,
        "weighted_mean_score": min(1.0, max(0.0, weighted)),
        "latency": latency_stats([o.latency_ms for o in raw]),
        "total_prompt_tokens": min(U64_MAX, sum(o.prompt_tokens for o in raw)),
        "total_completion_tokens": min(U64_MAX, sum(o.completion_tokens for o in raw)),
        "elapsed_secs": elapsed_secs if math.isfinite(elapsed_secs) else 0.0,
        "pass_rate_by_tag": {t: b["pass_rate"] for t, b in tag_breakdown.items()},
    }
    if tag_breakdown:
        metrics["tag_breakdown"] = tag_breakdown
    metrics["by_scorer"] = by_scorer
    if tool_counts:
        metrics["pass_rate_by_tool"] = {t: _rate_breakdown(p, c) for t, (p, c) in sorted(tool_counts.items())}
    metrics["reasoning_length"] = reasoning_length_stats(raw)
    metrics["num_unclosed_thinking"] = sum(1 for o in raw if o.unclosed_thinking)
    metrics["num_non_xml_tool_calls"] = sum(1 for o in raw if _is_non_xml(o.detail))
    if confusion:
        metrics["confusion_by_tool"] = {t: dict(sorted(row.items())) for t, row in sorted(confusion.items())}
    # A completion re-scored (judge pass) may appear twice: count each (example, index) once.
    metrics["num_schema_missing_required"] = sum(o.schema_missing_required for o in raw_by_key.values())
    metrics["num_schema_extra_unknown"] = sum(o.schema_extra_unknown for o in raw_by_key.values())
    return metrics
