"""Built-in scorers (semantics.md §8.3-8.4): one module per kind, each a spec model and a pure `score`.

`score(spec, completion_text, example, ctx=None) -> ScoreResult`; `score_completion` in the registry
splits reasoning off a stored completion first and turns a ScorerError into an `error` outcome.
"""

from kiln.evals.scorers.base import ScoreContext, ScorerError, ScoreResult
from kiln.evals.scorers.registry import (
    ScoredCompletion,
    ScorerSpec,
    judge_adapters,
    parse_scorer,
    requires_judge,
    run_scorer,
    run_scorer_safely,
    score_completion,
    scorer_to_json,
)

__all__ = [
    "ScoreContext", "ScoreResult", "ScoredCompletion", "ScorerError", "ScorerSpec", "judge_adapters", "parse_scorer",
    "requires_judge", "run_scorer", "run_scorer_safely", "score_completion", "scorer_to_json",
]
