"""The per-decode-step thinking-budget controller (semantics.md §2.4, outcome §2.5).

The engine builds one per choice when the budget applies (`thinking_budget.applies`) and calls
`step(generated, sampled)` once per decode candidate, before appending: it returns the token to append
and whether the controller forced it. Forced close tokens enter KV history and count toward usage and
max_tokens like any other completion token.

The close sequence is the tokenizer's own encoding of `</think>`, possibly several ordinary tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

Trigger = Literal["tokens", "time", "max_tokens"]


class BudgetState(Enum):
    ACTIVE = "active"
    NATURALLY_CLOSED = "naturally_closed"
    FORCING = "forcing"
    CLOSED = "closed"  # forced closure completed


@dataclass(frozen=True)
class StepResult:
    token_id: int
    forced: bool


class ThinkingBudgetController:
    def __init__(
        self,
        close_ids: Sequence[int],
        *,
        max_thinking_tokens: int | None,
        max_time_ms: int | None,
        max_completion_tokens: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_thinking_tokens is None and max_time_ms is None:
            raise ValueError("a thinking-budget controller needs a finite token or time limit")
        if not close_ids:
            raise ValueError("the reasoning close sequence is empty")
        if max_completion_tokens < len(close_ids):
            raise ValueError(
                f"max_completion_tokens {max_completion_tokens} cannot fit the {len(close_ids)}-token close sequence"
            )
        self.close_ids = list(close_ids)
        self.max_thinking_tokens = max_thinking_tokens
        self.max_time_ms = max_time_ms
        self.max_completion_tokens = max_completion_tokens
        self._clock = clock
        self._start: float | None = None
        self.state = BudgetState.ACTIVE
        self.trigger: Trigger | None = None
        self._frozen_tokens: int | None = None
        self._frozen_ms: float | None = None

    @property
    def closed(self) -> bool:
        return self.state in (BudgetState.NATURALLY_CLOSED, BudgetState.CLOSED)

    def _elapsed_ms(self) -> float:
        now = self._clock()
        if self._start is None:
            # The clock starts at the first decode candidate: queueing and prefill are excluded.
            self._start = now
        return (now - self._start) * 1000.0

    def _progress(self, generated: Sequence[int]) -> int:
        """Length of the longest proper prefix of the close sequence that `generated` ends with."""
        close = self.close_ids
        for n in range(min(len(close) - 1, len(generated)), 0, -1):
            if list(generated[len(generated) - n :]) == close[:n]:
                return n
        return 0

    def _freeze(self, thinking_tokens: int, elapsed_ms: float) -> None:
        self._frozen_tokens = thinking_tokens
        self._frozen_ms = elapsed_ms

    def step(self, generated: Sequence[int], sampled: int) -> StepResult:
        """Decide the token for this candidate; `generated` is the completion so far (no prompt)."""
        if self.closed:
            return StepResult(sampled, False)
        elapsed = self._elapsed_ms()
        close = self.close_ids
        if len(generated) >= len(close) and list(generated[len(generated) - len(close) :]) == close:
            if self.state is BudgetState.ACTIVE:
                self.state = BudgetState.NATURALLY_CLOSED
                self._freeze(len(generated) - len(close), elapsed)
            else:
                self.state = BudgetState.CLOSED
            return StepResult(sampled, False)

        progress = self._progress(generated)
        thinking_tokens = len(generated) - progress
        expected = close[progress]
        completes = progress + 1 == len(close)

        if self.state is BudgetState.FORCING:
            if completes:
                self.state = BudgetState.CLOSED
            return StepResult(expected, True)

        trigger = self._trigger(thinking_tokens, elapsed, len(generated))
        if sampled == expected:
            # The model is closing on its own (rule 7), also when a boundary was just reached (rule 8).
            if completes:
                self.state = BudgetState.NATURALLY_CLOSED
                self._freeze(thinking_tokens, elapsed)
            return StepResult(sampled, False)
        if trigger is None:
            return StepResult(sampled, False)
        self.trigger = trigger
        self._freeze(thinking_tokens, elapsed)
        self.state = BudgetState.CLOSED if completes else BudgetState.FORCING
        return StepResult(expected, True)

    def _trigger(self, thinking_tokens: int, elapsed_ms: float, num_generated: int) -> Trigger | None:
        # Priority tokens > time > capacity: both limits reached at one boundary report `tokens`.
        if self.max_thinking_tokens is not None and thinking_tokens >= self.max_thinking_tokens:
            return "tokens"
        if self.max_time_ms is not None and elapsed_ms >= self.max_time_ms:
            return "time"
        # Reserve just enough completion slots for the whole close sequence.
        if num_generated + len(self.close_ids) >= self.max_completion_tokens:
            return "max_tokens"
        return None

    def outcome(self, completion_tokens: int) -> dict[str, Any]:
        """`choices[].thinking_budget` once the request has ended (after the last step).

        Never closed and never forced: the whole completion was thinking. A forced closure cut short
        by stop/EOS/length stays triggered with closed false.
        """
        if self._frozen_tokens is None:
            tokens = completion_tokens
            ms = self._elapsed_ms() if self._start is not None else 0.0
        else:
            tokens = self._frozen_tokens
            ms = self._frozen_ms or 0.0
        out: dict[str, Any] = {"triggered": self.trigger is not None}
        if self.trigger is not None:
            out["trigger"] = self.trigger
        out["closed"] = self.closed
        out["thinking_tokens"] = max(0, tokens)
        out["thinking_time_ms"] = max(0, int(ms))
        return out
