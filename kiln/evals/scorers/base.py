"""What every scorer returns, and the shared vocabulary of the scorer modules."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from kiln.evals.thinking import ThinkingSplit

OutcomeKind = Literal["pass", "fail", "invalid", "error"]
PASS: OutcomeKind = "pass"
FAIL: OutcomeKind = "fail"
INVALID: OutcomeKind = "invalid"
ERROR: OutcomeKind = "error"

# A judge turns a prompt into the judge model's reply text.
Judge = Callable[[str], str]


class SpecModel(BaseModel):
    """Scorer specs: strict JSON types, unknown fields ignored (the contract says so per variant)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class ScorerError(Exception):
    """The scorer cannot run for this example (missing target, bad regex, no judge): an `error` outcome."""


@dataclass(frozen=True)
class ScoreResult:
    outcome: OutcomeKind
    score: float
    detail: str = ""
    # Tool-call evidence the metrics need (confusion matrix, schema counts); empty for other scorers.
    predicted_tools: tuple[str, ...] = ()
    schema_missing_required: int = 0
    schema_extra_unknown: int = 0

    def __post_init__(self) -> None:
        score = self.score if math.isfinite(self.score) else 0.0
        object.__setattr__(self, "score", min(1.0, max(0.0, float(score))))

    @property
    def passed(self) -> bool:
        return self.outcome == PASS


def passed(score: float = 1.0, detail: str = "") -> ScoreResult:
    return ScoreResult(PASS, score, detail)


def failed(score: float = 0.0, detail: str = "") -> ScoreResult:
    return ScoreResult(FAIL, score, detail)


def invalid(detail: str) -> ScoreResult:
    return ScoreResult(INVALID, 0.0, detail)


def errored(detail: str) -> ScoreResult:
    return ScoreResult(ERROR, 0.0, detail)


def scorer_error(err: Exception) -> ScoreResult:
    return errored(f"scorer error: {err}")


@dataclass(frozen=True)
class ScoreContext:
    """What a scorer may use beyond the answer text."""

    judge: Judge | None = None
    # The split of the whole completion; the tool_call scorer explains a missing call with it.
    thinking: ThinkingSplit | None = None
    # The example's effective tools catalogue (suite tools unless the example has its own).
    tools: list[Any] = field(default_factory=list)


class Example(Protocol):
    """The parts of a resolved example a scorer reads."""

    id: str
    messages: list[dict[str, Any]]
    target: str | None
    aliases: list[str]


@dataclass(frozen=True)
class ExampleView:
    """A stand-in example, e.g. one tool argument scored as if it were a whole answer."""

    id: str
    messages: list[dict[str, Any]]
    target: str | None
    aliases: list[str] = field(default_factory=list)


def preview(text: str, limit: int = 32) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def require_target(example: Example, kind: str) -> str:
    target = example.target
    if target is None:
        raise ScorerError(f"{kind} scorer needs a target")
    return target


def candidates(example: Example, kind: str) -> list[str]:
    """Target first, then aliases: every answer the example accepts."""
    return [require_target(example, kind), *example.aliases]
