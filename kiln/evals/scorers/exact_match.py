"""exact_match: the normalized answer equals the target or an alias (semantics.md §8.3)."""

from __future__ import annotations

import unicodedata
from typing import Literal

from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScoreResult,
    SpecModel,
    candidates,
    failed,
    passed,
    preview,
)


class ExactMatchSpec(SpecModel):
    kind: Literal["exact_match"] = "exact_match"
    case_sensitive: bool = True
    strip_whitespace: bool = True


def _normalize(spec: ExactMatchSpec, text: str) -> str:
    text = unicodedata.normalize("NFC", text)
    if spec.strip_whitespace:
        text = text.strip()
    if not spec.case_sensitive:
        text = text.lower()
    return text


def score(spec: ExactMatchSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    accepted = candidates(example, "exact_match")
    got = _normalize(spec, completion_text)
    for cand in accepted:
        if _normalize(spec, cand) == got:
            return passed(1.0, f"matched {preview(cand)!r}")
    return failed(0.0, f"expected {preview(accepted[0])!r}, got {preview(got)!r}")
