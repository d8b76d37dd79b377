"""Synthesis bodies (semantics.md §10.1): defaults, the sampling quirk, and 400s naming the field."""

import pytest

from kiln.errors import KilnError
from kiln.evals.synthesis.config import parse_preview_body, parse_synthesize_body


def test_defaults_follow_the_contract():
    body = parse_synthesize_body({"suite_name": "s"})
    assert body.strategy == "final_assistant"
    assert body.scorer.kind == "auto_detect"
    assert body.source_split == "holdout"
    assert (body.force, body.run_against, body.strip_system_prompt) == (False, None, False)
    assert body.aggregation.kind == "single" and body.generation is None
    s = body.sampling
    assert (s.max_examples, s.max_prompt_chars, s.max_target_chars, s.seed, s.dedupe) == (100, 32768, 4096, None, True)


def test_preview_defaults_to_five_conversations_of_holdout():
    body = parse_preview_body({"suite_name": "s"})
    assert (body.head_n, body.source_split) == (5, "holdout")


def test_a_sampling_object_without_max_examples_is_unlimited():
    assert parse_synthesize_body({"suite_name": "s", "sampling": {"seed": 1}}).sampling.max_examples is None
    assert parse_synthesize_body({"suite_name": "s", "sampling": {"max_examples": None}}).sampling.max_examples is None


def test_the_seed_accepts_a_decimal_string():
    body = parse_synthesize_body({"suite_name": "s", "sampling": {"seed": "18446744073709551615"}})
    assert body.sampling.seed == 2**64 - 1


def test_unknown_fields_are_ignored():
    assert parse_synthesize_body({"suite_name": "s", "bogus": 1, "sampling": {"extra": True}}).suite_name == "s"


def test_a_fixed_scorer_is_parsed_as_a_scorer():
    body = parse_synthesize_body({"suite_name": "s", "scorer": {"kind": "fixed", "scorer": {"kind": "contains",
                                                                                             "phrases": ["x"]}}})
    assert body.scorer.scorer.kind == "contains"


BAD = [
    ({"suite_name": "s", "strategy": "random"}, "strategy"),
    ({"suite_name": "s", "sampling": {"max_examples": "10"}}, "sampling.max_examples"),
    ({"suite_name": "s", "sampling": {"max_examples": 0}}, "sampling.max_examples"),
    ({"suite_name": "s", "sampling": {"max_prompt_chars": -1}}, "sampling.max_prompt_chars"),
    ({"suite_name": "s", "sampling": {"seed": 2**64}}, "sampling.seed"),
    ({"suite_name": "s", "sampling": {"dedupe": "yes"}}, "sampling.dedupe"),
    ({"suite_name": "s", "scorer": {"kind": "fixed"}}, "scorer.scorer"),
    ({"suite_name": "s", "scorer": {"kind": "fixed", "scorer": {"kind": "exact_match", "case_sensitive": "no"}}},
     "scorer.scorer.case_sensitive"),
    ({"suite_name": "s", "scorer": {"kind": "guess"}}, "scorer"),
    ({"suite_name": "s", "aggregation": {"kind": "pass_at_k"}}, "aggregation.k"),
    ({"suite_name": "s", "generation": {"temperature": "hot"}}, "generation.temperature"),
    ({"suite_name": "s", "source_split": "test"}, "source_split"),
    ({"suite_name": "s", "run_against": [1]}, "run_against[0]"),
    ({"suite_name": "s", "suite_tools": [{"type": "function"}]}, "suite_tools[0]"),
    ({}, "suite_name"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_a_bad_field_is_a_400_naming_it(body, param):
    with pytest.raises(KilnError) as e:
        parse_synthesize_body(body)
    assert (e.value.status, e.value.code, e.value.param) == (400, "eval_invalid_request", param)
    assert e.value.message.startswith(f"Invalid eval request: {param}")


@pytest.mark.parametrize("name", ["", " padded", "a/b", ".."])
def test_a_bad_suite_name_is_invalid_suite_name(name):
    with pytest.raises(KilnError) as e:
        parse_preview_body({"suite_name": name})
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_suite_name", "suite_name")


def test_head_n_must_not_be_negative():
    with pytest.raises(KilnError) as e:
        parse_preview_body({"suite_name": "s", "head_n": -1})
    assert e.value.param == "head_n"


def test_the_body_must_be_an_object():
    with pytest.raises(KilnError) as e:
        parse_synthesize_body([1])
    assert e.value.code == "eval_invalid_request"
