"""contains: phrase containment in any / all / none mode (semantics.md §8.3)."""

from __future__ import annotations

from typing import Literal

from kiln.evals.scorers.base import Example, ScoreContext, ScoreResult, SpecModel, failed, invalid, passed


class ContainsSpec(SpecModel):
    kind: Literal["contains"] = "contains"
    phrases: list[str]
    mode: Literal["any", "all", "none"] = "any"
    case_sensitive: bool = True


def score(spec: ContainsSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    if not spec.phrases:
        return invalid("contains scorer has no phrases")
    text = completion_text if spec.case_sensitive else completion_text.lower()
    hits = [p for p in spec.phrases if (p if spec.case_sensitive else p.lower()) in text]
    total = len(spec.phrases)
    detail = f"{len(hits)}/{total} phrases found (mode {spec.mode})"
    if spec.mode == "any":
        return passed(1.0, detail) if hits else failed(0.0, detail)
    if spec.mode == "all":
        return passed(1.0, detail) if len(hits) == total else failed(len(hits) / total, detail)
    return passed(1.0, detail) if not hits else failed(0.0, detail + f"; found {hits[0]!r}")
