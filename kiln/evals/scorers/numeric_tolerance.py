"""numeric_tolerance: the last number in the answer is within atol + rtol*|target| (§8.3)."""

from __future__ import annotations

import math
import re
from typing import Literal

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

_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class NumericToleranceSpec(SpecModel):
    kind: Literal["numeric_tolerance"] = "numeric_tolerance"
    atol: float = 0.0
    rtol: float = 0.0
    integer_only: bool = False


def scan_numbers(text: str) -> list[float]:
    """Numbers in reading order: thousands commas dropped, '$' and '%' treated as spaces."""
    text = text.replace(",", "").replace("$", " ").replace("%", " ")
    out = []
    for m in _NUMBER_RE.finditer(text):
        value = float(m.group(0))
        if math.isfinite(value):
            out.append(value)
    return out


def parse_target(target: str | None) -> float:
    # The newer guide's rule: a numeric target holds exactly one number ("42", "$1,200", "-3.5e2").
    if target is None:
        raise ScorerError("numeric_tolerance scorer needs a target")
    numbers = scan_numbers(target)
    if len(numbers) != 1:
        raise ScorerError(f"numeric target must contain exactly one number, got {preview(target)!r}")
    return numbers[0]


def score(spec: NumericToleranceSpec, completion_text: str, example: Example, ctx: ScoreContext | None = None) -> ScoreResult:
    target = parse_target(example.target)
    numbers = scan_numbers(completion_text)
    if not numbers:
        return invalid("no number found in completion")
    got = numbers[-1]
    if spec.integer_only and not got.is_integer():
        return failed(0.0, f"got {got:g}, expected an integer")
    allowed = spec.atol + spec.rtol * abs(target)
    if abs(got - target) <= allowed:
        return passed(1.0, f"got {got:g}, target {target:g}")
    return failed(0.0, f"got {got:g}, target {target:g} (tolerance {allowed:g})")
