"""The scorer union, dispatch by kind, and scoring one stored completion (semantics.md §8.3, §3.7)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from kiln.evals.scorers import (
    all_of,
    any_of,
    code,
    contains,
    exact_match,
    json_validity,
    llm_judge,
    multiple_choice,
    numeric_tolerance,
    python_doctest,
    regex,
    tool_args,
    tool_call,
)
from kiln.evals.scorers.base import Example, Judge, ScoreContext, ScorerError, ScoreResult, scorer_error
from kiln.evals.thinking import ThinkingSplit, split_thinking

ScorerSpec = Annotated[
    exact_match.ExactMatchSpec
    | contains.ContainsSpec
    | regex.RegexSpec
    | json_validity.JsonValiditySpec
    | multiple_choice.MultipleChoiceSpec
    | numeric_tolerance.NumericToleranceSpec
    | llm_judge.LlmJudgeSpec
    | tool_call.ToolCallSpec
    | code.CodeSpec
    | python_doctest.PythonDoctestSpec
    | all_of.AllSpec
    | any_of.AnySpec,
    Field(discriminator="kind"),
]

# The recursive variants name ScorerSpec before it exists; resolve those forward references now.
for _model in (all_of.AllSpec, any_of.AnySpec, tool_args.PerKeyArgs, tool_call.ToolCallSpec):
    _model.model_rebuild(_types_namespace={"ScorerSpec": ScorerSpec})

SCORERS: dict[str, Callable[..., ScoreResult]] = {
    "exact_match": exact_match.score,
    "contains": contains.score,
    "regex": regex.score,
    "json_validity": json_validity.score,
    "multiple_choice": multiple_choice.score,
    "numeric_tolerance": numeric_tolerance.score,
    "llm_judge": llm_judge.score,
    "tool_call": tool_call.score,
    "code": code.score,
    "python_doctest": python_doctest.score,
    "all": all_of.score,
    "any": any_of.score,
}

_ADAPTER: TypeAdapter[Any] = TypeAdapter(ScorerSpec)


def parse_scorer(data: Any) -> ScorerSpec:
    """Validate a scorer object; raises pydantic.ValidationError naming the bad field."""
    return _ADAPTER.validate_python(data)


def scorer_to_json(spec: ScorerSpec) -> dict[str, Any]:
    return _ADAPTER.dump_python(spec, mode="json", exclude_unset=True) | {"kind": spec.kind}


def run_scorer(spec: ScorerSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    """One scorer on answer text; ScorerError propagates."""
    return SCORERS[spec.kind](spec, completion_text, example, ctx)


def run_scorer_safely(spec: ScorerSpec, completion_text: str, example: Example,
                      ctx: ScoreContext | None = None) -> ScoreResult:
    """One scorer on answer text; a ScorerError becomes this completion's `error` outcome."""
    try:
        return run_scorer(spec, completion_text, example, ctx)
    except ScorerError as e:
        return scorer_error(e)


@dataclass(frozen=True)
class ScoredCompletion:
    result: ScoreResult
    thinking: ThinkingSplit

    @property
    def reasoning_text(self) -> str | None:
        return self.thinking.reasoning

    @property
    def unclosed_thinking(self) -> bool:
        return self.thinking.unclosed


def score_completion(spec: ScorerSpec, completion_text: str, example: Example, judge: Judge | None = None,
                     *, tools: list[Any] | None = None) -> ScoredCompletion:
    """Score a stored completion: reasoning is split off first and the scorer sees only the answer.

    `completion_text` is the normalized text (`thinking.normalize_completion`), so a prompt that opened
    the thinking block still yields a reasoning part. `tools` is the example's effective catalogue.
    """
    thinking = split_thinking(completion_text)
    ctx = ScoreContext(judge=judge, thinking=thinking, tools=list(tools or []))
    return ScoredCompletion(run_scorer_safely(spec, thinking.answer, example, ctx), thinking)


def requires_judge(spec: ScorerSpec) -> bool:
    if isinstance(spec, llm_judge.LlmJudgeSpec):
        return True
    if isinstance(spec, all_of.AllSpec | any_of.AnySpec):
        return any(requires_judge(s) for s in spec.scorers)
    if isinstance(spec, tool_call.ToolCallSpec) and isinstance(spec.args, tool_args.PerKeyArgs):
        return any(requires_judge(s) for s in spec.args.scorers.values())
    return False


def judge_adapters(spec: ScorerSpec) -> list[str | None]:
    """Judge adapters a scorer needs, in first-use order (None = base model); the judge pass groups by it."""
    out: list[str | None] = []

    def walk(s: Any) -> None:
        if isinstance(s, llm_judge.LlmJudgeSpec):
            if s.judge_adapter not in out:
                out.append(s.judge_adapter)
        elif isinstance(s, all_of.AllSpec | any_of.AnySpec):
            for sub in s.scorers:
                walk(sub)
        elif isinstance(s, tool_call.ToolCallSpec) and isinstance(s.args, tool_args.PerKeyArgs):
            for sub in s.args.scorers.values():
                walk(sub)

    walk(spec)
    return out


__all__ = [
    "ScorerSpec", "SCORERS", "ScoredCompletion", "ValidationError", "parse_scorer", "scorer_to_json", "run_scorer",
    "run_scorer_safely", "score_completion", "requires_judge", "judge_adapters",
]
