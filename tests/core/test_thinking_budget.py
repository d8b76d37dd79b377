"""Thinking-budget resolution, applicability, pre-decode checks and records (semantics.md §2.1-2.3, §2.5)."""

from __future__ import annotations

import pytest

from kiln.config import ServerSettings
from kiln.core.thinking_budget import (
    EffectiveBudget,
    ServerBudgetDefaults,
    applies,
    budget_record,
    check_budget_request,
    check_close_sequence,
    check_max_tokens_fits,
    check_stop_strings,
    outcome_label,
    parse_source,
    read_record,
    resolve_budget,
    resolve_eval_budget,
    stop_conflicts_with_close,
)
from kiln.errors import KilnError
from kiln.testing.schemas import validate

TB = "thinking-budget-v1.schema.json"
DEFAULTS = ServerBudgetDefaults(tokens=64, time_ms=1500)
NONE = ServerBudgetDefaults()


def _effective(e: EffectiveBudget) -> dict:
    d = e.to_dict()
    validate(TB, "effective", d)
    return d


# ---- resolution ---------------------------------------------------------------------------------


def test_absent_fields_inherit_the_server_defaults():
    assert _effective(resolve_budget({}, DEFAULTS)) == {
        "configured": True,
        "max_tokens": 64,
        "max_time_ms": 1500,
        "tokens_source": "server_default",
        "time_source": "server_default",
    }


def test_absent_fields_without_defaults_are_unlimited_and_unconfigured():
    assert _effective(resolve_budget({}, NONE)) == {
        "configured": False,
        "tokens_source": "unlimited",
        "time_source": "unlimited",
    }


def test_zero_is_a_finite_request_limit_and_the_other_dimension_still_inherits():
    e = resolve_budget({"thinking_budget_tokens": 0}, DEFAULTS)
    assert (e.max_tokens, e.tokens_source) == (0, "request")
    assert (e.max_time_ms, e.time_source) == (1500, "server_default")
    _effective(e)


def test_explicit_null_is_request_unlimited_and_beats_a_finite_default():
    e = resolve_budget({"thinking_budget_ms": None}, DEFAULTS)
    assert e.max_time_ms is None and e.time_source == "request_unlimited"
    assert "max_time_ms" not in _effective(e)


def test_scope_names_the_source_for_example_limits_and_removals():
    e = resolve_budget(
        {"thinking_budget_tokens": 3, "thinking_budget_ms": None},
        ServerBudgetDefaults(tokens=9, time_ms=900),
        scope="example",
    )
    assert (e.tokens_source, e.time_source) == ("example", "example_unlimited")
    assert _effective(e) == {"configured": True, "max_tokens": 3, "tokens_source": "example",
                             "time_source": "example_unlimited"}


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_malformed_request_limit_is_a_400_naming_the_field(bad):
    with pytest.raises(KilnError) as exc:
        resolve_budget({"thinking_budget_tokens": bad}, NONE)
    assert exc.value.status == 400
    assert exc.value.code == "chat_invalid_request"
    assert exc.value.param == "thinking_budget_tokens"


def test_server_defaults_read_from_settings_treat_unlimited_as_none():
    settings = ServerSettings(default_thinking_budget_tokens=128, default_thinking_budget_ms="unlimited")
    defaults = ServerBudgetDefaults.from_settings(settings)
    assert defaults.to_dict() == {"default_thinking_budget_tokens": 128, "default_thinking_budget_ms": None}
    validate(TB, "serverDefaults", defaults.to_dict())
    assert resolve_budget({}, settings).tokens_source == "server_default"


def test_server_defaults_may_be_given_as_a_server_defaults_mapping():
    e = resolve_budget({}, {"default_thinking_budget_tokens": None, "default_thinking_budget_ms": 250})
    assert (e.max_tokens, e.max_time_ms, e.time_source) == (None, 250, "server_default")


def test_eval_generation_objects_take_whole_object_precedence():
    suite = {"thinking_budget_tokens": 5}
    run = {"thinking_budget_ms": 100}
    e = resolve_eval_budget(None, run, suite, NONE)
    # The run override wins whole: the suite's token limit is not merged in.
    assert (e.max_tokens, e.tokens_source, e.max_time_ms, e.time_source) == (None, "unlimited", 100, "run_override")
    assert resolve_eval_budget({}, run, suite, DEFAULTS).tokens_source == "server_default"
    assert resolve_eval_budget(None, None, suite, NONE).tokens_source == "suite"


def test_unknown_source_strings_read_as_unknown():
    assert parse_source("request") == "request"
    assert parse_source("from_the_moon") == "unknown"


# ---- applicability ------------------------------------------------------------------------------


def test_applies_only_when_configured_thinking_and_at_least_one_completion_token():
    configured = resolve_budget({"thinking_budget_tokens": 8}, NONE)
    assert applies(configured, thinking_enabled=True, max_tokens=1)
    assert not applies(configured, thinking_enabled=False, max_tokens=100)
    assert not applies(configured, thinking_enabled=True, max_tokens=0)
    assert not applies(resolve_budget({}, NONE), thinking_enabled=True, max_tokens=100)


# ---- pre-decode checks --------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["", "</think>", "x</think>y", "think", "</", ">", "k>\n", "ab</t", "\n</th"])
def test_stop_strings_overlapping_the_close_sequence_conflict(stop):
    assert stop_conflicts_with_close(stop)


@pytest.mark.parametrize("stop", ["\n\n", "Answer:", "<|im_end|>", "thinking"])
def test_stop_strings_disjoint_from_the_close_sequence_do_not_conflict(stop):
    assert not stop_conflicts_with_close(stop)


def test_a_conflicting_stop_string_is_a_400_naming_its_position():
    with pytest.raises(KilnError) as exc:
        check_stop_strings(["\n\n", "</think>"])
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "chat_invalid_request", "stop[1]")
    assert exc.value.hint


def test_a_close_sequence_that_does_not_round_trip_is_a_400():
    with pytest.raises(KilnError) as exc:
        check_close_sequence([5, 6], "</ think>")
    assert exc.value.status == 400 and exc.value.param == "thinking_budget_tokens"
    with pytest.raises(KilnError):
        check_close_sequence([], "")
    check_close_sequence([5, 6], "</think>")


def test_max_tokens_smaller_than_the_close_sequence_is_a_400_naming_max_tokens():
    with pytest.raises(KilnError) as exc:
        check_max_tokens_fits(2, 3)
    assert exc.value.status == 400 and exc.value.param == "max_tokens"
    assert "3-token" in exc.value.message
    check_max_tokens_fits(3, 3)


def test_pre_decode_checks_run_only_when_the_controller_applies():
    budget = resolve_budget({"thinking_budget_ms": 10}, NONE)
    # Not thinking: a conflicting stop and a tiny max_tokens are fine because nothing will be forced.
    assert not check_budget_request(budget, thinking_enabled=False, max_tokens=1, stops=["</think>"],
                                    close_ids=[1, 2, 3], close_decoded="</think>")
    with pytest.raises(KilnError) as exc:
        check_budget_request(budget, thinking_enabled=True, max_tokens=2, stops=[],
                             close_ids=[1, 2, 3], close_decoded="</think>")
    assert exc.value.param == "max_tokens"
    assert check_budget_request(budget, thinking_enabled=True, max_tokens=3, stops=["\n\n"],
                                close_ids=[1, 2, 3], close_decoded="</think>")


def test_the_round_trip_error_names_the_time_field_when_only_time_is_limited():
    budget = resolve_budget({"thinking_budget_ms": 10}, NONE)
    with pytest.raises(KilnError) as exc:
        check_budget_request(budget, thinking_enabled=True, max_tokens=30, stops=[],
                             close_ids=[9], close_decoded="</thnk>")
    assert exc.value.param == "thinking_budget_ms"


# ---- records ------------------------------------------------------------------------------------


def test_an_inert_record_has_applied_false_and_no_outcome_fields():
    rec = budget_record(resolve_budget({}, DEFAULTS), applied=False)
    validate(TB, "record", rec)
    assert list(rec) == ["configured", "applied", "max_tokens", "max_time_ms", "tokens_source",
                         "time_source", "triggered"]
    assert rec["triggered"] is False


def test_an_unconfigured_record_matches_the_contract_example():
    rec = budget_record(resolve_budget({}, NONE), applied=False)
    validate(TB, "record", rec)
    assert rec == {"configured": False, "applied": False, "tokens_source": "unlimited",
                   "time_source": "unlimited", "triggered": False}


def test_an_applied_record_carries_the_flat_outcome_in_order():
    outcome = {"triggered": True, "trigger": "tokens", "closed": True, "thinking_tokens": 2, "thinking_time_ms": 7}
    validate(TB, "outcome", outcome)
    rec = budget_record(resolve_budget({"thinking_budget_tokens": 2}, NONE), applied=True, outcome=outcome)
    validate(TB, "record", rec)
    assert list(rec) == ["configured", "applied", "max_tokens", "tokens_source", "time_source", "triggered",
                         "trigger", "closed", "thinking_tokens", "thinking_time_ms"]


def test_an_outcome_without_an_applied_controller_is_refused():
    with pytest.raises(ValueError):
        budget_record(resolve_budget({"thinking_budget_tokens": 2}, NONE), applied=False,
                      outcome={"triggered": False, "closed": True, "thinking_tokens": 1, "thinking_time_ms": 0})


def test_reading_a_legacy_nested_outcome_flattens_it():
    rec = read_record({"configured": True, "applied": True, "max_tokens": 4, "tokens_source": "suite",
                       "time_source": "weird", "triggered": False,
                       "outcome": {"triggered": False, "closed": True, "thinking_tokens": 3, "thinking_time_ms": 1}})
    assert rec["closed"] is True and rec["thinking_tokens"] == 3 and rec["time_source"] == "unknown"
    validate(TB, "record", rec)


def test_reading_a_record_with_both_nested_and_flat_outcomes_fails():
    with pytest.raises(ValueError):
        read_record({"configured": True, "applied": True, "max_tokens": 4, "tokens_source": "suite",
                     "time_source": "unlimited", "triggered": False, "closed": True,
                     "outcome": {"triggered": False, "closed": True, "thinking_tokens": 3, "thinking_time_ms": 1}})


@pytest.mark.parametrize(
    "bad",
    [
        {"configured": True, "tokens_source": "unlimited", "time_source": "unlimited", "triggered": False},
        {"configured": False, "max_tokens": 3, "tokens_source": "request", "time_source": "unlimited"},
        {"configured": True, "max_tokens": 3, "tokens_source": "request_unlimited", "time_source": "unlimited"},
        {"configured": False, "applied": True, "tokens_source": "unlimited", "time_source": "unlimited"},
    ],
)
def test_reading_an_inconsistent_record_fails(bad):
    with pytest.raises(ValueError):
        read_record(bad)


def test_outcome_labels_cover_every_terminal_state():
    base = {"configured": True, "applied": True, "max_tokens": 1, "tokens_source": "request",
            "time_source": "unlimited"}
    assert outcome_label({"configured": False}) == "unconfigured"
    assert outcome_label({**base, "applied": False, "triggered": False}) == "inert"
    assert outcome_label({**base, "triggered": False}) == "unresolved"
    done = {"thinking_tokens": 1, "thinking_time_ms": 0}
    assert outcome_label({**base, **done, "triggered": False, "closed": True}) == "natural_close"
    assert outcome_label({**base, **done, "triggered": False, "closed": False}) == "unclosed"
    assert outcome_label({**base, **done, "triggered": True, "trigger": "time", "closed": True}) == "time"
    assert outcome_label({**base, **done, "triggered": True, "trigger": "time", "closed": False}) == "interrupted"
