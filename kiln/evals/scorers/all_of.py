"""all: every sub-scorer must pass; the score is their mean (semantics.md §8.3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from kiln.evals.scorers.base import ERROR, FAIL, PASS, Example, ScoreContext, ScoreResult, SpecModel, invalid

if TYPE_CHECKING:
    from kiln.evals.scorers.registry import ScorerSpec


class AllSpec(SpecModel):
    kind: Literal["all"] = "all"
    scorers: list[ScorerSpec]


def sub_results(specs: list[ScorerSpec], completion_text: str, example: Example,
                ctx: ScoreContext | None) -> list[tuple[str, ScoreResult]]:
    from kiln.evals.scorers.registry import run_scorer_safely  # the registry imports this module

    return [(spec.kind, run_scorer_safely(spec, completion_text, example, ctx)) for spec in specs]


def joined_detail(results: list[tuple[str, ScoreResult]]) -> str:
    return "; ".join(f"{label}: {r.detail}" for label, r in results)


def merged_tool_evidence(results: list[tuple[str, ScoreResult]]) -> dict:
    """Keep tool-call evidence from sub-scorers so metrics still see it through a combinator."""
    first = next((r for _, r in results if r.predicted_tools), None)
    return {
        "predicted_tools": first.predicted_tools if first else (),
        "schema_missing_required": max((r.schema_missing_required for _, r in results), default=0),
        "schema_extra_unknown": max((r.schema_extra_unknown for _, r in results), default=0),
    }


def score(spec: AllSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    if not spec.scorers:
        return invalid("all scorer has no sub-scorers")
    results = sub_results(spec.scorers, completion_text, example, ctx)
    mean = sum(r.score for _, r in results) / len(results)
    if any(r.outcome == ERROR for _, r in results):
        outcome = ERROR
    elif all(r.outcome == PASS for _, r in results):
        outcome = PASS
    else:
        outcome = FAIL
    return ScoreResult(outcome, mean, joined_detail(results), **merged_tool_evidence(results))
