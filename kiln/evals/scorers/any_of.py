"""any: one passing sub-scorer is enough; the score is their maximum (semantics.md §8.3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kiln.evals.scorers.all_of import joined_detail, merged_tool_evidence, sub_results
from kiln.evals.scorers.base import FAIL, PASS, Example, ScoreContext, ScoreResult, SpecModel, invalid

if TYPE_CHECKING:
    from kiln.evals.scorers.registry import ScorerSpec


class AnySpec(SpecModel):
    kind: Literal["any"] = "any"
    scorers: list[ScorerSpec]


def score(spec: AnySpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    if not spec.scorers:
        return invalid("any scorer has no sub-scorers")
    results = sub_results(spec.scorers, completion_text, example, ctx)
    best = max(r.score for _, r in results)
    outcome = PASS if any(r.outcome == PASS for _, r in results) else FAIL
    return ScoreResult(outcome, best, joined_detail(results), **merged_tool_evidence(results))
