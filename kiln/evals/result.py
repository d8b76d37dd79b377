"""A SuiteResult (the contract's object) from one run's raw outcomes: aggregate, measure, serialize."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from kiln.evals.aggregate import aggregate_outcomes
from kiln.evals.metrics import compute_metrics, example_info
from kiln.evals.outcome import ExampleOutcome
from kiln.evals.suite import EvalSuite, ResolvedExample, aggregation_to_json, resolve_examples, suite_hash


def rfc3339(ts: datetime | str) -> str:
    if isinstance(ts, str):
        return ts
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def aggregate_suite(
    suite: EvalSuite,
    outcomes: Sequence[ExampleOutcome],
    *,
    adapter: str | None,
    started_at: datetime | str,
    finished_at: datetime | str,
    examples: Sequence[ResolvedExample] | None = None,
    elapsed_secs: float | None = None,
    suite_sha256: str | None = None,
    effective_generation_hash: str | None = None,
    replay_record: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The SuiteResult dict for one suite and adapter.

    `examples` are the resolved examples the run used (default: resolved from the suite); `outcomes`
    are all raw outcomes, k per example. Raises AggregationError when the groups are incomplete.
    """
    resolved = list(examples) if examples is not None else resolve_examples(suite)
    aggregated = aggregate_outcomes(suite.aggregation, outcomes)
    if elapsed_secs is None:
        if isinstance(started_at, datetime) and isinstance(finished_at, datetime):
            elapsed_secs = max(0.0, (finished_at - started_at).total_seconds())
        else:
            elapsed_secs = 0.0
    metrics = compute_metrics(aggregated, outcomes, {ex.id: example_info(ex) for ex in resolved},
                              elapsed_secs=elapsed_secs)
    result: dict[str, Any] = {
        "suite_name": suite.name,
        "adapter": adapter,
        "aggregation": aggregation_to_json(suite.aggregation),
        "metrics": metrics,
        "aggregated_outcomes": [a.to_wire() for a in aggregated],
        "outcomes": [o.to_wire() for o in outcomes],
        "started_at": rfc3339(started_at),
        "finished_at": rfc3339(finished_at),
        "suite_hash": suite_sha256 or suite_hash(suite),
    }
    if effective_generation_hash is not None:
        result["effective_generation_hash"] = effective_generation_hash
    if replay_record is not None:
        result["replay_record"] = replay_record
    return result
