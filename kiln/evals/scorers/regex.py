"""regex: a pattern search, optionally comparing one capture group to the target (semantics.md §8.3)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScorerError,
    ScoreResult,
    SpecModel,
    candidates,
    failed,
    invalid,
    passed,
    preview,
)


class RegexSpec(SpecModel):
    kind: Literal["regex"] = "regex"
    pattern: str
    capture_group: int | None = Field(default=None, ge=0)
    case_sensitive: bool = True


def compile_pattern(spec: RegexSpec) -> re.Pattern[str]:
    try:
        return re.compile(spec.pattern, 0 if spec.case_sensitive else re.IGNORECASE)
    except re.error as e:
        raise ScorerError(f"invalid regex {spec.pattern!r}: {e}") from None


def score(spec: RegexSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    pattern = compile_pattern(spec)
    m = pattern.search(completion_text)
    if m is None:
        return failed(0.0, "pattern not found")
    if spec.capture_group is None:
        return passed(1.0, f"matched {preview(m.group(0))!r}")
    accepted = candidates(example, "regex")
    if spec.capture_group > pattern.groups:
        raise ScorerError(f"capture_group {spec.capture_group} but the pattern has {pattern.groups} group(s)")
    captured = m.group(spec.capture_group)
    if captured is None:
        return invalid(f"capture group {spec.capture_group} did not participate in the match")
    # Surrounding whitespace is formatting, not content: compare trimmed text.
    got = captured.strip()
    for cand in accepted:
        if _equal(got, cand.strip(), spec.case_sensitive):
            return passed(1.0, f"captured {preview(got)!r}")
    return failed(0.0, f"captured {preview(got)!r}, expected {preview(accepted[0])!r}")


def _equal(a: str, b: str, case_sensitive: bool) -> bool:
    if case_sensitive:
        return a == b
    return _ascii_lower(a) == _ascii_lower(b)


def _ascii_lower(s: str) -> str:
    return "".join(c.lower() if c.isascii() else c for c in s)
