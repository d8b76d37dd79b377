"""Small builders shared by the eval tests."""

from __future__ import annotations

from typing import Any

from kiln.evals.scorers import ScoreResult, parse_scorer, run_scorer_safely
from kiln.evals.scorers.base import ExampleView, ScoreContext


def example(target: str | None = None, aliases: tuple[str, ...] = (), user: str = "question?",
            messages: list[dict[str, Any]] | None = None, example_id: str = "ex-1") -> ExampleView:
    return ExampleView(example_id, messages or [{"role": "user", "content": user}], target, list(aliases))


def score(spec: dict[str, Any], completion: str, target: str | None = None, *, aliases: tuple[str, ...] = (),
          user: str = "question?", ctx: ScoreContext | None = None) -> ScoreResult:
    """Run one scorer from its JSON spec on answer text, ScorerError recorded as an error outcome."""
    return run_scorer_safely(parse_scorer(spec), completion, example(target, aliases, user), ctx)


def suite_json(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "math-smoke",
        "description": "arithmetic",
        "default_scorer": {"kind": "exact_match", "case_sensitive": False},
        "examples": [
            {"id": "two-plus-two", "messages": [{"role": "user", "content": "2 + 2?"}], "target": "4",
             "tags": ["math"]},
            {"id": "three-plus-three", "messages": [{"role": "user", "content": "3 + 3?"}], "target": "6",
             "tags": ["math", "easy"]},
        ],
        "schema_version": 2,
    }
    base.update(overrides)
    return base
