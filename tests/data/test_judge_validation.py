"""The judge-validate-<name> suite built from held-out judgments (semantics.md §11.4)."""

from __future__ import annotations

import pytest

from kiln.data.judge_prompt import JUDGE_SYSTEM_PROMPT, render_judge_prompt
from kiln.data.judge_validation import plan_validation
from kiln.data.judgment_rows import JudgmentRow
from kiln.errors import KilnError
from kiln.evals.scorers import run_scorer
from kiln.evals.suite import parse_suite, resolve_examples
from kiln.testing.schemas import validate

WINNERS = ["a", "b", "tie", "skip"]


def row(i: int, winner: str = "a", **extra) -> JudgmentRow:
    return JudgmentRow(id=f"j{i}", prompt=[{"role": "user", "content": f"question {i}"}],
                       response_a=f"long answer {i}", response_b=f"short {i}", winner=winner,
                       submitted_at="2026-01-01T00:00:00Z", **extra)


def rows(n: int) -> list[JudgmentRow]:
    return [row(i, WINNERS[i % 4]) for i in range(n)]


def test_uses_the_last_holdout_rows_and_drops_skips():
    plan = plan_validation("prefs", rows(10), holdout_n=5, last_compiled_split=5)
    # rows 5..9 are b, tie, skip, a, b; the skip (j7) is left out.
    assert [e["id"] for e in plan.suite["examples"]] == ["j5", "j6", "j8", "j9"]
    assert [e["target"] for e in plan.suite["examples"]] == ["B", "Tie", "A", "B"]
    assert (plan.holdout_n, plan.first_row) == (5, 5)
    assert plan.warnings == ["1 skip judgment(s) among the last 5 have no label and were left out"]


def test_default_holdout_is_20_and_zero_still_takes_one_row():
    assert plan_validation("p", rows(30), last_compiled_split=10).first_row == 10
    plan = plan_validation("p", rows(5), holdout_n=0, last_compiled_split=4)
    assert [e["id"] for e in plan.suite["examples"]] == ["j4"] and plan.warnings == []
    # More than there are: every row, counted from the start.
    assert plan_validation("p", rows(3), holdout_n=50, last_compiled_split=None).first_row == 0


def test_suite_is_a_valid_schema_v1_suite_with_the_judge_prompt_and_tags():
    data = plan_validation("style-prefs", [row(0, "a"), row(1, "tie", tags=["style", "long"], adapter_b="v2")],
                           holdout_n=1, last_compiled_split=1).suite
    validate("kiln-evals-v1.schema.json", "EvalSuite", data)
    assert data["name"] == "judge-validate-style-prefs" and data["schema_version"] == 1
    assert data["generation"] == {"temperature": 0.0, "max_tokens": 64}
    assert data["default_scorer"] == {"kind": "regex", "pattern": r"(?i)Winner:\s*(A|B|Tie)", "capture_group": 1,
                                      "case_sensitive": False}
    (ex,) = data["examples"]
    assert ex["messages"] == [
        {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
        {"role": "user", "content": render_judge_prompt([{"role": "user", "content": "question 1"}],
                                                        "long answer 1", "short 1")}]
    assert ex["tags"] == ["style", "long"] and ex["target"] == "Tie"
    assert ex["scorer"] == data["default_scorer"] and ex["generation"] == data["generation"]
    assert ex["metadata"] == {"judgment": "style-prefs", "judgment_id": "j1", "winner": "tie", "adapter_b": "v2"}
    suite = parse_suite(data)
    assert suite.k == 1 and suite.examples[0].generation.max_tokens == 64


@pytest.mark.parametrize(("reply", "target", "outcome"), [
    ("Winner: a", "A", "pass"), ("winner:B\nReason: shorter", "B", "pass"), ("WINNER: tie", "Tie", "pass"),
    ("Winner: B", "A", "fail"), ("I prefer the first reply.", "A", "fail"),
])
def test_the_regex_scorer_reads_the_verdict_case_insensitively(reply, target, outcome):
    winner = {"A": "a", "B": "b", "Tie": "tie"}[target]
    suite = parse_suite(plan_validation("p", [row(0), row(1, winner)], holdout_n=1, last_compiled_split=1).suite)
    (example,) = resolve_examples(suite)
    assert example.target == target
    assert run_scorer(example.scorer, reply, example).outcome == outcome


def test_never_compiled_warns_that_accuracy_may_include_training_rows():
    (warning,) = plan_validation("p", rows(3), holdout_n=1).warnings
    assert "never compiled" in warning and "training rows" in warning


def test_overlap_with_the_last_compile_warns():
    # Compiled with 8 training rows; validating the last 4 of 10 reaches back into rows 6 and 7.
    (warning,) = plan_validation("p", [row(i, "a") for i in range(10)], holdout_n=4, last_compiled_split=8).warnings
    assert "overlap" in warning and "2 of them" in warning
    assert plan_validation("p", [row(i, "a") for i in range(10)], holdout_n=2, last_compiled_split=8).warnings == []


@pytest.mark.parametrize(("source", "holdout_n", "param"), [
    ([], 20, "name"), ([row(0)], 20, "name"),
    ([row(0, "a"), row(1, "skip"), row(2, "skip")], 2, "holdout_n"), ([row(0), row(1)], -1, "holdout_n"),
])
def test_too_few_rows_an_all_skip_holdout_and_bad_holdout_are_400(source, holdout_n, param):
    with pytest.raises(KilnError) as e:
        plan_validation("p", source, holdout_n=holdout_n)
    assert (e.value.status, e.value.code, e.value.param) == (400, "judgment_invalid", param)


def test_a_name_too_long_for_the_suite_is_400():
    with pytest.raises(KilnError) as e:
        plan_validation("x" * 120, rows(3))
    assert e.value.status == 400 and "longer than 128" in e.value.message
