"""all / any combinators, parsing, and scoring a stored completion (semantics.md §8.3, §3.7)."""

import pytest
from pydantic import ValidationError

from kiln.evals.scorers import judge_adapters, parse_scorer, requires_judge, score_completion, scorer_to_json
from tests.evals._helpers import example, score

ALL = {"kind": "all", "scorers": [{"kind": "contains", "phrases": ["4"]}, {"kind": "regex", "pattern": "^4$"}]}
ANY = {"kind": "any", "scorers": [{"kind": "exact_match"}, {"kind": "contains", "phrases": ["four"]}]}


def test_all_passes_when_every_sub_scorer_passes():
    r = score(ALL, "4")
    assert (r.outcome, r.score) == ("pass", 1.0)
    assert r.detail == "contains: 1/1 phrases found (mode any); regex: matched '4'"


def test_all_scores_the_mean_and_fails_otherwise():
    r = score(ALL, "it is 4")
    assert (r.outcome, r.score) == ("fail", 0.5)


def test_all_is_an_error_when_a_sub_scorer_errors():
    r = score({"kind": "all", "scorers": [{"kind": "contains", "phrases": ["4"]}, {"kind": "exact_match"}]}, "4")
    assert r.outcome == "error" and "exact_match: scorer error" in r.detail


def test_any_passes_on_one_pass_and_scores_the_max():
    r = score(ANY, "four", "4")
    assert (r.outcome, r.score) == ("pass", 1.0)
    assert score(ANY, "five", "4").outcome == "fail"


@pytest.mark.parametrize("kind", ["all", "any"])
def test_combinators_without_sub_scorers_are_invalid(kind):
    assert score({"kind": kind, "scorers": []}, "x").outcome == "invalid"


def test_unknown_fields_are_ignored_but_unknown_kinds_are_rejected():
    assert parse_scorer({"kind": "exact_match", "colour": "red"}).kind == "exact_match"
    with pytest.raises(ValidationError):
        parse_scorer({"kind": "telepathy"})


def test_wrong_json_types_are_rejected():
    with pytest.raises(ValidationError):
        parse_scorer({"kind": "exact_match", "case_sensitive": "yes"})
    with pytest.raises(ValidationError):
        parse_scorer({"kind": "tool_call", "weights": {"name": -1, "structure": 1, "content": 1}})


def test_scorer_json_round_trips_only_what_was_given():
    data = {"kind": "any", "scorers": [{"kind": "regex", "pattern": "x"}]}
    assert scorer_to_json(parse_scorer(data)) == data


def test_score_completion_scores_the_answer_not_the_reasoning():
    scored = score_completion(parse_scorer({"kind": "exact_match"}), "<think>\nmaybe 5\n</think>\n\n4", example("4"))
    assert scored.result.outcome == "pass"
    assert scored.reasoning_text == "maybe 5"
    assert scored.unclosed_thinking is False


def test_score_completion_reports_unclosed_thinking():
    scored = score_completion(parse_scorer({"kind": "contains", "phrases": ["4"]}), "<think>\n4 4 4", example("4"))
    assert scored.result.outcome == "fail"
    assert scored.unclosed_thinking is True


def test_score_completion_passes_tools_to_the_schema_check():
    target = '{"name": "f", "arguments": {"a": 1}}'
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}]
    scored = score_completion(parse_scorer({"kind": "tool_call"}), target, example(target), tools=tools)
    assert scored.result.schema_missing_required == 1


def test_judge_requirements_are_found_in_nested_scorers():
    spec = parse_scorer({"kind": "all", "scorers": [
        {"kind": "llm_judge", "judge_adapter": "judge-v1"},
        {"kind": "tool_call", "args": {"kind": "per_key", "scorers": {"q": {"kind": "llm_judge"}}}}]})
    assert requires_judge(spec)
    assert judge_adapters(spec) == ["judge-v1", None]
    assert not requires_judge(parse_scorer({"kind": "exact_match"}))
