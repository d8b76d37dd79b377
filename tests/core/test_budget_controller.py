"""The per-decode-step thinking-budget controller: semantics.md §2.4 test vectors and §2.5 outcomes."""

from __future__ import annotations

import pytest

from kiln.core.budget_controller import BudgetState, ThinkingBudgetController
from kiln.core.thinking_budget import budget_record, resolve_budget
from kiln.testing.schemas import validate

TB = "thinking-budget-v1.schema.json"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance_ms(self, ms: float) -> None:
        self.t += ms / 1000.0


def run(ctrl: ThinkingBudgetController, samples: list[int], clock: FakeClock | None = None,
        step_ms: float = 0.0) -> tuple[list[int], list[bool]]:
    """Feed samples in order, appending whatever the controller emits; returns (generated, forced flags)."""
    generated: list[int] = []
    forced: list[bool] = []
    for s in samples:
        r = ctrl.step(generated, s)
        generated.append(r.token_id)
        forced.append(r.forced)
        if clock is not None:
            clock.advance_ms(step_ms)
    return generated, forced


def outcome(ctrl: ThinkingBudgetController, completion_tokens: int) -> dict:
    out = ctrl.outcome(completion_tokens)
    validate(TB, "outcome", out)
    return out


# ---- §2.4 vectors -------------------------------------------------------------------------------


def test_token_budget_forces_the_whole_close_sequence_then_frees_sampling():
    ctrl = ThinkingBudgetController([90, 91, 92], max_thinking_tokens=2, max_time_ms=None,
                                    max_completion_tokens=16, clock=FakeClock())
    generated, forced = run(ctrl, [10, 11, 12, 13, 14, 15, 16])
    assert generated == [10, 11, 90, 91, 92, 15, 16]
    assert forced == [False, False, True, True, True, False, False]
    assert outcome(ctrl, len(generated)) == {"triggered": True, "trigger": "tokens", "closed": True,
                                             "thinking_tokens": 2, "thinking_time_ms": 0}


def test_time_budget_passes_below_the_limit_and_forces_at_it():
    clock = FakeClock()
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=None, max_time_ms=25,
                                    max_completion_tokens=100, clock=clock)
    assert ctrl.step([], 10).token_id == 10  # starts the clock
    clock.advance_ms(24)
    assert ctrl.step([10], 11) .token_id == 11
    clock.advance_ms(1)
    r = ctrl.step([10, 11], 12)
    assert (r.token_id, r.forced) == (90, True)
    assert ctrl.step([10, 11, 90], 13).token_id == 91
    assert outcome(ctrl, 4) == {"triggered": True, "trigger": "time", "closed": True,
                                "thinking_tokens": 2, "thinking_time_ms": 25}


def test_a_natural_close_at_the_token_boundary_is_kept_and_untriggered():
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=1, max_time_ms=None,
                                    max_completion_tokens=16, clock=FakeClock())
    r = ctrl.step([10], 90)
    assert (r.token_id, r.forced) == (90, False)
    r = ctrl.step([10, 90], 91)
    assert (r.token_id, r.forced) == (91, False)
    assert ctrl.state is BudgetState.NATURALLY_CLOSED
    assert outcome(ctrl, 3) == {"triggered": False, "closed": True, "thinking_tokens": 1, "thinking_time_ms": 0}


def test_completion_capacity_forces_the_close_when_just_enough_room_remains():
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=1000, max_time_ms=None,
                                    max_completion_tokens=5, clock=FakeClock())
    generated, forced = run(ctrl, [10, 11, 12, 13, 14])
    assert generated == [10, 11, 12, 90, 91]
    assert forced == [False, False, False, True, True]
    assert outcome(ctrl, 5) == {"triggered": True, "trigger": "max_tokens", "closed": True,
                                "thinking_tokens": 3, "thinking_time_ms": 0}


# ---- further behaviour --------------------------------------------------------------------------


def test_budget_zero_forces_on_the_first_candidate():
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=0, max_time_ms=None,
                                    max_completion_tokens=8, clock=FakeClock())
    generated, forced = run(ctrl, [10, 11, 12])
    assert generated == [90, 91, 12] and forced == [True, True, False]
    assert outcome(ctrl, 3)["thinking_tokens"] == 0


def test_tokens_win_over_time_when_both_are_reached_at_the_same_boundary():
    clock = FakeClock()
    ctrl = ThinkingBudgetController([90], max_thinking_tokens=1, max_time_ms=5, max_completion_tokens=8, clock=clock)
    ctrl.step([], 10)
    clock.advance_ms(5)
    assert ctrl.step([10], 11).token_id == 90
    assert ctrl.trigger == "tokens"


def test_a_partial_natural_close_is_continued_by_forcing_from_where_the_model_left_off():
    ctrl = ThinkingBudgetController([90, 91, 92], max_thinking_tokens=2, max_time_ms=None,
                                    max_completion_tokens=16, clock=FakeClock())
    # The model emits the first close token itself, then wanders off; thinking stays at 2.
    generated, forced = run(ctrl, [10, 11, 90, 50, 51, 52])
    assert generated == [10, 11, 90, 91, 92, 52]
    assert forced == [False, False, False, True, True, False]
    assert outcome(ctrl, 6) == {"triggered": True, "trigger": "tokens", "closed": True,
                                "thinking_tokens": 2, "thinking_time_ms": 0}


def test_a_natural_close_without_any_limit_reached_records_its_thinking_and_time():
    clock = FakeClock()
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=100, max_time_ms=None,
                                    max_completion_tokens=100, clock=clock)
    generated, forced = run(ctrl, [10, 11, 12, 90, 91, 7, 8], clock=clock, step_ms=3)
    assert generated == [10, 11, 12, 90, 91, 7, 8] and not any(forced)
    assert outcome(ctrl, 7) == {"triggered": False, "closed": True, "thinking_tokens": 3, "thinking_time_ms": 12}


def test_never_closed_and_never_triggered_counts_the_whole_completion_as_thinking():
    clock = FakeClock()
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=100, max_time_ms=None,
                                    max_completion_tokens=100, clock=clock)
    run(ctrl, [10, 11, 12], clock=clock, step_ms=4)
    # The request ended (EOS counts as a completion token) with thinking still open.
    assert outcome(ctrl, 4) == {"triggered": False, "closed": False, "thinking_tokens": 4, "thinking_time_ms": 12}


def test_a_forced_close_cut_short_by_the_request_end_stays_triggered_and_unclosed():
    ctrl = ThinkingBudgetController([90, 91, 92], max_thinking_tokens=1, max_time_ms=None,
                                    max_completion_tokens=16, clock=FakeClock())
    run(ctrl, [10, 11])  # forced 90, then the request stopped
    assert outcome(ctrl, 2) == {"triggered": True, "trigger": "tokens", "closed": False,
                                "thinking_tokens": 1, "thinking_time_ms": 0}


def test_after_closing_the_controller_never_touches_the_sample_again():
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=0, max_time_ms=None,
                                    max_completion_tokens=4, clock=FakeClock())
    generated, forced = run(ctrl, [1, 2, 3, 4])
    # Capacity would fire again on [90, 91, 3] but the block is already closed.
    assert generated == [90, 91, 3, 4] and forced == [True, True, False, False]


def test_a_close_sequence_sampled_while_forcing_is_still_recorded_as_forced():
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=0, max_time_ms=None,
                                    max_completion_tokens=4, clock=FakeClock())
    assert ctrl.step([], 5).forced
    r = ctrl.step([90], 91)
    assert (r.token_id, r.forced) == (91, True)
    assert ctrl.trigger == "tokens"


@pytest.mark.parametrize(
    ("kwargs", "close"),
    [
        ({"max_thinking_tokens": None, "max_time_ms": None, "max_completion_tokens": 10}, [1]),
        ({"max_thinking_tokens": 1, "max_time_ms": None, "max_completion_tokens": 10}, []),
        ({"max_thinking_tokens": 1, "max_time_ms": None, "max_completion_tokens": 2}, [1, 2, 3]),
    ],
)
def test_construction_refuses_no_limit_an_empty_close_or_too_little_capacity(kwargs, close):
    with pytest.raises(ValueError):
        ThinkingBudgetController(close, **kwargs)


@pytest.mark.parametrize(
    "samples",
    [[10, 11, 12, 13, 14, 15], [90, 91, 5], [10, 90, 91], [10], [], [10, 11, 90]],
)
def test_every_outcome_makes_a_valid_applied_record(samples):
    budget = resolve_budget({"thinking_budget_tokens": 2}, {"default_thinking_budget_tokens": None,
                                                            "default_thinking_budget_ms": None})
    ctrl = ThinkingBudgetController([90, 91], max_thinking_tokens=budget.max_tokens, max_time_ms=None,
                                    max_completion_tokens=6, clock=FakeClock())
    generated, _ = run(ctrl, samples)
    rec = budget_record(budget, applied=True, outcome=outcome(ctrl, len(generated)))
    validate(TB, "record", rec)
    validate(TB, "recentRecord", rec)
