"""llm_judge: a judge model grades the answer; this module builds its prompt and reads its verdict (§8.3).

The model call itself happens outside (`ScoreContext.judge`), in a deferred second pass that groups
completions by judge adapter; until then a completion holds the `awaiting_judge()` placeholder.
"""

from __future__ import annotations

import re
from typing import Literal

from kiln.core.messages import message_text
from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScorerError,
    ScoreResult,
    SpecModel,
    failed,
    invalid,
    passed,
    preview,
)

DEFAULT_TEMPLATE = (
    "You are a strict grader. Compare the model answer with the reference answer and judge whether "
    "it correctly and completely answers the question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{target}\n\n"
    "Model answer:\n{answer}\n\n"
    "Reply with a score between 0 and 1, where 1 means fully correct and 0 means wrong, "
    "on a final line of the form `Score: <number>`.\n"
    "Score:"
)
DEFAULT_SCORE_REGEX = r"(?i)score[:\s]*([01](?:\.\d+)?)"
AWAITING_JUDGE = "awaiting judge pass"


class LlmJudgeSpec(SpecModel):
    kind: Literal["llm_judge"] = "llm_judge"
    judge_adapter: str | None = None
    template: str = DEFAULT_TEMPLATE
    score_regex: str = DEFAULT_SCORE_REGEX


def question_of(example: Example) -> str:
    """The last user message, else the last message, else ""."""
    for msg in reversed(example.messages):
        if msg.get("role") == "user":
            return message_text(msg.get("content"))
    return message_text(example.messages[-1].get("content")) if example.messages else ""


def build_judge_prompt(spec: LlmJudgeSpec, answer: str, example: Example) -> str:
    # Plain replacement in this order, so an answer that contains "{question}" is left alone.
    prompt = spec.template.replace("{question}", question_of(example))
    prompt = prompt.replace("{target}", example.target or "")
    return prompt.replace("{answer}", answer)


def parse_verdict(spec: LlmJudgeSpec, judge_reply: str) -> ScoreResult:
    try:
        pattern = re.compile(spec.score_regex)
    except re.error as e:
        raise ScorerError(f"invalid score_regex {spec.score_regex!r}: {e}") from None
    if pattern.groups < 1:
        raise ScorerError("score_regex needs a capture group 1 holding the score")
    m = pattern.search(judge_reply)
    if m is None or m.group(1) is None:
        return invalid(f"score not found in judge reply: {preview(judge_reply, 80)!r}")
    try:
        value = float(m.group(1))
    except ValueError:
        return invalid(f"judge score {m.group(1)!r} is not a number")
    value = min(1.0, max(0.0, value))
    detail = f"judge score {value:g}"
    return passed(value, detail) if value >= 0.5 else failed(value, detail)


def awaiting_judge() -> ScoreResult:
    return invalid(AWAITING_JUDGE)


def score(spec: LlmJudgeSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    judge = ctx.judge if ctx is not None else None
    if judge is None:
        raise ScorerError("llm_judge needs a judge model, and none was provided for this pass")
    prompt = build_judge_prompt(spec, completion_text, example)
    try:
        reply = judge(prompt)
    except Exception as e:  # the judge is a model call: any failure means "unavailable", not a crash
        return invalid(f"judge unavailable: {e}")
    return parse_verdict(spec, reply)
