"""tool_call scoring (semantics.md §8.4)."""

import pytest

from kiln.evals.scorers.base import ScoreContext
from kiln.evals.shell_similarity import command_similarity, unwrap
from kiln.evals.thinking import split_thinking
from tests.evals._helpers import score

TC = {"kind": "tool_call"}


def xml(name, **args):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


TARGET = xml("get_weather", city="Paris", days=3)


def test_identical_call_passes_with_full_score():
    r = score(TC, TARGET, TARGET)
    assert (r.outcome, r.score) == ("pass", 1.0)
    assert r.detail == "name=1.00 | struct=1.00 | content=1.00"
    assert r.predicted_tools == ("get_weather",)


def test_name_is_case_insensitive_by_default_and_exact_on_request():
    pred = xml("GET_WEATHER", city="Paris", days=3)
    assert score(TC, pred, TARGET).outcome == "pass"
    r = score({"kind": "tool_call", "name_match": {"kind": "exact"}}, pred, TARGET)
    assert (r.outcome, r.score) == ("fail", pytest.approx(0.6))


def test_one_of_accepts_listed_names():
    spec = {"kind": "tool_call", "name_match": {"kind": "one_of", "allowed": ["weather", "forecast"]}}
    assert score(spec, xml("forecast", city="Paris", days=3), TARGET).outcome == "pass"


def test_wrong_name_fails_even_with_perfect_arguments():
    r = score(TC, xml("get_time", city="Paris", days=3), TARGET)
    assert (r.outcome, r.score) == ("fail", pytest.approx(0.6))


def test_missing_argument_lowers_structure_and_content():
    r = score(TC, xml("get_weather", city="Paris"), TARGET)
    # name 1*0.4 + struct 0.5*0.3 + content (1 + 0)/2*0.3
    assert r.score == pytest.approx(0.4 + 0.15 + 0.15)
    assert r.outcome == "fail"


def test_numbers_match_within_relative_tolerance():
    r = score(TC, xml("get_weather", city="Paris", days=3.001), TARGET)
    assert r.outcome == "pass" and r.score == 1.0


def test_weights_are_normalized_by_their_sum():
    spec = {"kind": "tool_call", "weights": {"name": 2, "structure": 1, "content": 1}}
    r = score(spec, xml("other", city="Paris", days=3), TARGET)
    assert r.score == pytest.approx(0.5)


def test_keys_only_ignores_values():
    spec = {"kind": "tool_call", "args": {"kind": "keys_only"}}
    assert score(spec, xml("get_weather", city="Rome", days=9), TARGET).score == 1.0


def test_structural_needs_equal_arguments():
    spec = {"kind": "tool_call", "args": {"kind": "structural"}}
    assert score(spec, xml("get_weather", city="Rome", days=3), TARGET).score == pytest.approx(0.7)


def test_per_key_scores_configured_keys_with_nested_scorers():
    spec = {"kind": "tool_call", "args": {"kind": "per_key", "extra_key_penalty": 0.5, "scorers": {
        "city": {"kind": "exact_match", "case_sensitive": False}}}}
    assert score(spec, xml("get_weather", city="PARIS", days=1), TARGET).score == 1.0
    # An extra key neither configured nor in the target costs 0.5 of content.
    r = score(spec, xml("get_weather", city="paris", days=3, units="C"), TARGET)
    assert r.score == pytest.approx(0.4 + 0.3 + 0.3 * 0.5)


def test_no_predicted_call_is_invalid():
    r = score(TC, "The weather is nice.", TARGET)
    assert (r.outcome, r.detail) == ("invalid", "no tool_call found in completion")


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        ("<think>\nlet me think", "no tool_call found: thinking block never closed"),
        ("<think>\nplan\n</think>\n\n", "no tool_call found: emitted thinking but no answer"),
    ],
)
def test_missing_call_detail_explains_the_thinking_state(raw, detail):
    split = split_thinking(raw)
    r = score(TC, split.answer, TARGET, ctx=ScoreContext(thinking=split))
    assert (r.outcome, r.detail) == ("invalid", detail)


def test_target_without_a_call_is_a_scorer_error():
    assert score(TC, TARGET, "just text").outcome == "error"


def test_require_xml_rejects_json_only_predictions():
    pred = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    assert score(TC, pred, TARGET).outcome == "pass"
    r = score({"kind": "tool_call", "require_xml_format": True}, pred, TARGET)
    assert (r.outcome, r.score) == ("invalid", 0.0)


def test_non_xml_prediction_is_noted_in_the_detail():
    r = score(TC, '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}', TARGET)
    assert r.detail.endswith(" || formats=[json_inline]")


def test_excess_calls_are_penalized():
    r = score(TC, TARGET + "\n" + xml("get_time"), TARGET)
    assert r.score == pytest.approx(0.75)
    assert r.outcome == "fail"
    assert "excess_calls=1" in r.detail


def test_pairs_are_positional_and_a_missing_pair_scores_zero():
    target = TARGET + "\n" + xml("get_time", zone="UTC")
    r = score(TC, TARGET, target)
    assert r.score == pytest.approx(0.5)
    assert r.detail.startswith("[0] name=1.00") and "[1] name=0.00" in r.detail


def test_schema_problems_are_appended_and_counted():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {}}, "required": ["city", "country"]}}}]
    r = score(TC, TARGET, TARGET, ctx=ScoreContext(tools=tools))
    assert r.detail.endswith(" || schema: missing=country extra=days")
    assert (r.schema_missing_required, r.schema_extra_unknown) == (1, 1)


def test_command_arguments_use_shell_similarity():
    target = xml("bash", command="git status")
    r = score(TC, xml("bash", command="bash -lc 'git status'"), target)
    assert r.outcome == "pass" and r.score == 1.0


@pytest.mark.parametrize(
    ("target", "predicted", "expected"),
    [
        ("ls -la", "ls  -la", 1.0),
        ("git status", "git log", 0.35),
        ("grep foo x", "rg foo x", 0.35),
        ("ls -la", "curl example.com", 0.1),
        ("pytest -q tests", "pytest -q", 0.75),
        ("cd repo && make test", "make test", 1.0),
        ("sudo env A=1 apt-get install vim", "apt-get install vim", 1.0),
        ("python -c 'print(1)'", "python3 -c 'print(1)'", 1.0),
    ],
)
def test_shell_command_similarity(target, predicted, expected):
    assert command_similarity(target, predicted) == pytest.approx(expected)


def test_inline_python_mixes_code_tokens_and_argv():
    # code tokens {print, hello} vs {print, world}: 1/3; same interpreter flags: 1.0
    assert command_similarity("python -c 'print(hello)'", "python -c 'print(world)'") == pytest.approx(
        0.75 / 3 + 0.25)


def test_shell_wrappers_unwrap_at_most_four_levels():
    assert unwrap("bash -c \"sh -c 'ls -la'\"") == ["ls", "-la"]
    deep = "ls"
    for _ in range(6):
        deep = "bash -c " + __import__("shlex").quote(deep)
    assert unwrap(deep)[0] == "bash"


def test_prose_arguments_use_key_phrases():
    target = xml("note", text="remember to water the garden plants tomorrow morning early")
    good = xml("note", text="Please remember to water the garden plants tomorrow morning early!")
    r = score(TC, good, target)
    assert r.score == 1.0


@pytest.mark.parametrize(
    ("prediction", "label"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
         "json_inline"),
        ('```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n```', "fenced"),
        ('{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", '
         '\\"days\\": 3}"}}', "open_ai"),
    ],
)
def test_every_qwen_call_format_is_scored_and_labelled(prediction, label):
    r = score(TC, prediction, TARGET)
    assert (r.outcome, r.score) == ("pass", 1.0)
    assert r.detail.endswith(f" || formats=[{label}]")


def test_open_call_block_at_the_end_still_counts():
    # Generation stops on "</tool_call>" and the stop text is not returned.
    r = score(TC, TARGET.removesuffix("</tool_call>"), TARGET)
    assert r.outcome == "pass"
