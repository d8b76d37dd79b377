"""tool_call: score predicted tool calls against the target calls pair by pair (semantics.md §8.4)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from kiln.core.tool_calls import ParsedToolCall, extract_tool_calls, schema_issues
from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScorerError,
    ScoreResult,
    SpecModel,
    invalid,
)
from kiln.evals.scorers.tool_args import ArgsScoring, AutoArgs, content_score, structure_score

XML = "qwen3_xml"
PASS_THRESHOLD = 0.8
EXCESS_CALL_PENALTY = 0.25


class ExactName(SpecModel):
    kind: Literal["exact"] = "exact"


class CaseInsensitiveName(SpecModel):
    kind: Literal["case_insensitive"] = "case_insensitive"


class OneOfName(SpecModel):
    kind: Literal["one_of"] = "one_of"
    allowed: list[str]


NameMatch = Annotated[ExactName | CaseInsensitiveName | OneOfName, Field(discriminator="kind")]


class ToolCallWeights(SpecModel):
    name: float
    structure: float
    content: float

    @model_validator(mode="after")
    def _usable(self) -> ToolCallWeights:
        if min(self.name, self.structure, self.content) < 0 or self.name + self.structure + self.content <= 0:
            raise ValueError("weights must be non-negative with a positive sum")
        return self


DEFAULT_WEIGHTS = ToolCallWeights(name=0.4, structure=0.3, content=0.3)


class ToolCallSpec(SpecModel):
    kind: Literal["tool_call"] = "tool_call"
    name_match: NameMatch = CaseInsensitiveName()
    args: ArgsScoring = AutoArgs()
    weights: ToolCallWeights | None = None
    require_xml_format: bool = False


def name_score(policy: Any, target: str, predicted: str) -> float:
    if isinstance(policy, ExactName):
        return 1.0 if predicted == target else 0.0
    if isinstance(policy, OneOfName):
        return 1.0 if predicted == target or predicted in policy.allowed else 0.0
    return 1.0 if predicted.casefold() == target.casefold() else 0.0


def _format_label(fmt: str) -> str:
    # "formats=[xml" is what the non-XML metric looks for (semantics.md §8.7).
    return "xml" if fmt == XML else fmt


def _no_call_detail(ctx: ScoreContext | None) -> str:
    thinking = ctx.thinking if ctx is not None else None
    if thinking is not None and thinking.unclosed:
        return "no tool_call found: thinking block never closed"
    if thinking is not None and thinking.had_thinking and not thinking.answer.strip():
        return "no tool_call found: emitted thinking but no answer"
    return "no tool_call found in completion"


def score(spec: ToolCallSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    if example.target is None:
        raise ScorerError("tool_call scorer needs a target")
    # The chat server's extractor: a call the server would emit is a call the scorer sees. With a
    # tools catalogue, XML parameter values are typed by the tool's schema on both sides.
    tools = ctx.tools if ctx is not None else []
    targets = extract_tool_calls(example.target, tools)
    if not targets:
        raise ScorerError("target has no parseable tool call")
    predicted = extract_tool_calls(completion_text, tools)
    names = tuple(c.name for c in predicted)
    if not predicted:
        return invalid(_no_call_detail(ctx))
    if spec.require_xml_format and all(c.format != XML for c in predicted):
        return ScoreResult("invalid", 0.0, "tool call not in the required XML format", predicted_tools=names)

    w = spec.weights or DEFAULT_WEIGHTS
    total_w = w.name + w.structure + w.content
    pair_scores: list[float] = []
    details: list[str] = []
    all_names_perfect = True
    for i, target in enumerate(targets):
        pred = predicted[i] if i < len(predicted) else None
        if pred is None:
            n = s = c = 0.0
        else:
            n = name_score(spec.name_match, target.name, pred.name)
            s = structure_score(target.arguments, pred.arguments)
            c = content_score(spec.args, target.arguments, pred.arguments, example, ctx)
        all_names_perfect &= n == 1.0
        pair_scores.append((n * w.name + s * w.structure + c * w.content) / total_w)
        prefix = f"[{i}] " if len(targets) > 1 else ""
        details.append(f"{prefix}name={n:.2f} | struct={s:.2f} | content={c:.2f}")

    excess = max(0, len(predicted) - len(targets))
    final = sum(pair_scores) / len(pair_scores) - excess * (EXCESS_CALL_PENALTY / len(targets))
    final = min(1.0, max(0.0, final))
    detail = " || ".join(details)
    if excess:
        detail += f" || excess_calls={excess}"
    if any(c.format != XML for c in predicted):
        detail += " || formats=[" + ",".join(_format_label(c.format) for c in predicted) + "]"
    missing, extra = _schema_problems(predicted, tools)
    if missing or extra:
        detail += f" || schema: missing={','.join(missing)} extra={','.join(extra)}"
    outcome = "pass" if all_names_perfect and final >= PASS_THRESHOLD else "fail"
    return ScoreResult(outcome, final, detail, predicted_tools=names,
                       schema_missing_required=len(missing), schema_extra_unknown=len(extra))


def _schema_problems(calls: list[ParsedToolCall], tools: list[Any]) -> tuple[list[str], list[str]]:
    missing: list[str] = []
    extra: list[str] = []
    for call in calls:
        m, e = schema_issues(call, tools)
        missing += m
        extra += e
    return missing, extra
