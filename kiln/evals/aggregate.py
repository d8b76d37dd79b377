"""Reduce each example's k raw outcomes to one aggregated outcome (semantics.md §8.6)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.evals.outcome import ExampleOutcome
from kiln.evals.scorers.base import ERROR, FAIL, INVALID, PASS, OutcomeKind


class AggregationError(ValueError):
    """The raw outcomes do not form complete, consistent groups of k (an invalid definition)."""


@dataclass(frozen=True)
class AggregatedOutcome:
    example_id: str
    kind: OutcomeKind
    score: float
    completion_indices: list[int]
    representative_completion_index: int
    num_pass: int
    num_fail: int
    num_invalid: int
    num_error: int
    tags: list[str] = field(default_factory=list)
    metadata: Any = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "example_id": self.example_id,
            "kind": self.kind,
            "score": self.score,
            "completion_indices": list(self.completion_indices),
            "representative_completion_index": self.representative_completion_index,
            "num_pass": self.num_pass,
            "num_fail": self.num_fail,
            "num_invalid": self.num_invalid,
            "num_error": self.num_error,
        }
        if self.tags:
            out["tags"] = list(self.tags)
        if self.metadata is not None:
            out["metadata"] = self.metadata
        return out


def group_outcomes(outcomes: Sequence[ExampleOutcome]) -> dict[str, list[ExampleOutcome]]:
    groups: dict[str, list[ExampleOutcome]] = {}
    for o in outcomes:
        groups.setdefault(o.example_id, []).append(o)
    return groups


def _fallback(kinds: list[OutcomeKind]) -> OutcomeKind:
    if FAIL in kinds:
        return FAIL
    return INVALID if INVALID in kinds else ERROR


def _check_group(example_id: str, group: list[ExampleOutcome], k: int) -> list[ExampleOutcome]:
    ordered = sorted(group, key=lambda o: o.completion_index)
    if [o.completion_index for o in ordered] != list(range(k)):
        raise AggregationError(
            f"example {example_id}: expected completion indices 0..{k - 1}, got "
            f"{[o.completion_index for o in group]}"
        )
    for o in ordered[1:]:
        if o.tags != ordered[0].tags or o.metadata != ordered[0].metadata:
            raise AggregationError(f"example {example_id}: tags/metadata differ between completions")
    for o in ordered:
        if not (math.isfinite(o.score) and 0.0 <= o.score <= 1.0):
            raise AggregationError(f"example {example_id}: completion {o.completion_index} score {o.score} not in [0, 1]")
    return ordered


def aggregate_example(aggregation: Any, group: Sequence[ExampleOutcome]) -> AggregatedOutcome:
    """`aggregation` is a suite aggregation model (kind, k)."""
    k = aggregation.k
    example_id = group[0].example_id
    ordered = _check_group(example_id, list(group), k)
    kinds = [o.kind for o in ordered]
    scores = [o.score for o in ordered]
    passes = [i for i, kind in enumerate(kinds) if kind == PASS]
    kind: OutcomeKind
    if aggregation.kind == "single":
        kind, score, rep = kinds[0], scores[0], 0
    elif aggregation.kind == "mean_at_k":
        score = sum(scores) / k
        if not passes and FAIL not in kinds:
            kind = _fallback(kinds)
        else:
            kind = PASS if score >= 0.5 else FAIL
        # Closest to the mean; min() keeps the lowest index on ties.
        rep = min(range(k), key=lambda i: abs(scores[i] - score))
    elif aggregation.kind == "pass_at_k":
        kind, score, rep = (PASS, 1.0, passes[0]) if passes else (_fallback(kinds), 0.0, 0)
    elif aggregation.kind == "majority_at_k":
        if len(passes) > k // 2:
            kind, score, rep = PASS, 1.0, passes[0]
        else:
            rep = next(i for i, kind_i in enumerate(kinds) if kind_i != PASS)
            kind, score = _fallback(kinds), 0.0
    else:
        raise AggregationError(f"unknown aggregation kind {aggregation.kind!r}")
    return AggregatedOutcome(
        example_id=example_id,
        kind=kind,
        score=score,
        completion_indices=list(range(k)),
        representative_completion_index=rep,
        num_pass=kinds.count(PASS),
        num_fail=kinds.count(FAIL),
        num_invalid=kinds.count(INVALID),
        num_error=kinds.count(ERROR),
        tags=list(ordered[0].tags),
        metadata=ordered[0].metadata,
    )


def aggregate_outcomes(aggregation: Any, outcomes: Sequence[ExampleOutcome]) -> list[AggregatedOutcome]:
    """One aggregated outcome per example, in first-appearance order."""
    return [aggregate_example(aggregation, group) for group in group_outcomes(outcomes).values()]
