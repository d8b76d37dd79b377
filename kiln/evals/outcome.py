"""One scored completion (the contract's ExampleOutcome) and how a run builds it.

A job runner generates `Completion`s and calls `build_outcome`; scoring, the reasoning split and the
tool-call evidence the metrics need all happen here, so runners only generate and persist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.core.tool_calls import extract_tool_calls
from kiln.evals.scorers import ScoredCompletion, requires_judge, score_completion
from kiln.evals.scorers.base import ERROR, Judge, OutcomeKind, ScoreResult
from kiln.evals.scorers.llm_judge import AWAITING_JUDGE, awaiting_judge
from kiln.evals.suite import ResolvedExample
from kiln.evals.thinking import normalize_completion, split_thinking

_SCHEMA_DETAIL_RE = re.compile(r"schema: missing=([^ |]*) extra=([^ |]*)")


@dataclass(frozen=True)
class Completion:
    """What generation produced for one (example, completion index)."""

    raw_text: str
    latency_ms: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    thinking_budget: dict[str, Any] | None = None  # thinking-budget-v1 record, when the controller ran
    # Set when generation failed ("generation failed: ...", "prepare failed: ..."): an `error` outcome.
    error: str | None = None


@dataclass(frozen=True)
class ExampleOutcome:
    example_id: str
    completion_index: int
    completion_text: str
    kind: OutcomeKind
    score: float
    detail: str = ""
    generation_seed: int | None = None
    raw_completion_text: str | None = None
    thinking_budget: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    tags: list[str] = field(default_factory=list)
    metadata: Any = None
    reasoning_text: str | None = None
    unclosed_thinking: bool = False
    # Evidence for the metrics; not part of the wire object.
    predicted_tools: tuple[str, ...] = ()
    schema_missing_required: int = 0
    schema_extra_unknown: int = 0

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"example_id": self.example_id, "completion_index": self.completion_index}
        if self.generation_seed is not None:
            out["generation_seed"] = str(self.generation_seed)
        out["completion_text"] = self.completion_text
        if self.raw_completion_text is not None:
            out["raw_completion_text"] = self.raw_completion_text
        if self.thinking_budget is not None:
            out["thinking_budget"] = self.thinking_budget
        out.update(kind=self.kind, score=self.score, detail=self.detail, prompt_tokens=self.prompt_tokens,
                   completion_tokens=self.completion_tokens, latency_ms=self.latency_ms)
        if self.tags:
            out["tags"] = list(self.tags)
        if self.metadata is not None:
            out["metadata"] = self.metadata
        if self.reasoning_text is not None:
            out["reasoning_text"] = self.reasoning_text
            out["unclosed_thinking"] = self.unclosed_thinking
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ExampleOutcome:
        """Rebuild a retained outcome; the tool evidence is re-derived from its text and detail."""
        text = d["completion_text"]
        detail = d.get("detail", "")
        m = _SCHEMA_DETAIL_RE.search(detail)
        seed = d.get("generation_seed")
        return cls(
            example_id=d["example_id"], completion_index=d["completion_index"], completion_text=text,
            kind=d["kind"], score=float(d["score"]), detail=detail,
            generation_seed=int(seed) if seed is not None else None,
            raw_completion_text=d.get("raw_completion_text"), thinking_budget=d.get("thinking_budget"),
            prompt_tokens=d.get("prompt_tokens", 0), completion_tokens=d.get("completion_tokens", 0),
            latency_ms=float(d.get("latency_ms", 0.0)), tags=list(d.get("tags", [])), metadata=d.get("metadata"),
            reasoning_text=d.get("reasoning_text"), unclosed_thinking=bool(d.get("unclosed_thinking", False)),
            predicted_tools=tuple(c.name for c in extract_tool_calls(split_thinking(text).answer)),
            schema_missing_required=len([x for x in m.group(1).split(",") if x]) if m else 0,
            schema_extra_unknown=len([x for x in m.group(2).split(",") if x]) if m else 0,
        )


def build_outcome(
    example: ResolvedExample,
    completion_index: int,
    completion: Completion,
    *,
    prompt_starts_in_reasoning: bool = False,
    generation_seed: int | None = None,
    judge: Judge | None = None,
    defer_judge: bool = False,
    scored: ScoredCompletion | None = None,
) -> ExampleOutcome:
    """Normalize, split and score one completion.

    `defer_judge=True` leaves judge-scored examples with the "awaiting judge pass" placeholder for
    `apply_judge` to replace once the judge adapter is loaded; `scored` reuses a result scored elsewhere.
    """
    text = normalize_completion(completion.raw_text, prompt_starts_in_reasoning)
    thinking = split_thinking(text)
    if completion.error is not None:
        result = ScoreResult(ERROR, 0.0, completion.error)
    elif scored is not None:
        result = scored.result
    elif defer_judge and requires_judge(example.scorer):
        result = awaiting_judge()
    else:
        result = score_completion(example.scorer, text, example, judge, tools=example.tools).result
    return ExampleOutcome(
        example_id=example.id,
        completion_index=completion_index,
        completion_text=text,
        kind=result.outcome,
        score=result.score,
        detail=result.detail,
        generation_seed=generation_seed,
        raw_completion_text=completion.raw_text,
        thinking_budget=completion.thinking_budget,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        latency_ms=completion.latency_ms,
        tags=list(example.tags),
        metadata=example.metadata,
        reasoning_text=thinking.reasoning,
        unclosed_thinking=thinking.unclosed,
        predicted_tools=result.predicted_tools,
        schema_missing_required=result.schema_missing_required,
        schema_extra_unknown=result.schema_extra_unknown,
    )


def apply_judge(outcome: ExampleOutcome, example: ResolvedExample, judge: Judge) -> ExampleOutcome:
    """The deferred judge pass: replace an "awaiting judge pass" placeholder with the judged result."""
    if outcome.detail != AWAITING_JUDGE:
        return outcome  # not waiting for a judge (e.g. generation failed): keep it
    result = score_completion(example.scorer, outcome.completion_text, example, judge, tools=example.tools).result
    return replace(outcome, kind=result.outcome, score=result.score, detail=result.detail,
                   predicted_tools=result.predicted_tools, schema_missing_required=result.schema_missing_required,
                   schema_extra_unknown=result.schema_extra_unknown)
