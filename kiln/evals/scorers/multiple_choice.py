"""multiple_choice: find the chosen label after an answer marker, else the first label (§8.3)."""

from __future__ import annotations

import re
from typing import Literal

from kiln.evals.scorers.base import (
    Example,
    ScoreContext,
    ScoreResult,
    SpecModel,
    candidates,
    failed,
    invalid,
    passed,
)

_MARKERS = ("ANSWER:", "ANSWER IS", "FINAL ANSWER:", "FINAL ANSWER IS")
_TOKEN_RE = re.compile(r"[A-Za-z0-9]+")


class MultipleChoiceSpec(SpecModel):
    kind: Literal["multiple_choice"] = "multiple_choice"
    choices: list[str] = ["A", "B", "C", "D"]


def _first_label(text: str, labels: set[str]) -> str | None:
    for tok in _TOKEN_RE.findall(text):
        if tok in labels:
            return tok
    return None


def pick_label(text: str, labels: set[str]) -> str | None:
    upper = text.upper()
    for marker in _MARKERS:
        at = upper.find(marker)
        if at >= 0:
            label = _first_label(upper[at + len(marker):], labels)
            if label is not None:
                return label
            break
    return _first_label(upper, labels)


def score(spec: MultipleChoiceSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    accepted = {c.strip().upper() for c in candidates(example, "multiple_choice")}
    target = example.target.strip().upper() if example.target is not None else ""
    labels = {c.strip().upper() for c in spec.choices} | {target}
    label = pick_label(completion_text, labels)
    if label is None:
        return invalid("no choice label found in completion")
    if label in accepted:
        return passed(1.0, f"chose {label}")
    return failed(0.0, f"chose {label}, expected {target}")
