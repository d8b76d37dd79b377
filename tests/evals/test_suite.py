"""Suite parsing, defaults and validation (semantics.md §8.1-8.2)."""

import copy

import pytest

from kiln.errors import KilnError
from kiln.evals.example_id import derive_example_id
from kiln.evals.generation import GenerationParams
from kiln.evals.suite import parse_suite, resolve_examples, suite_hash, suite_summary
from tests.evals._helpers import suite_json


def bad(data):
    with pytest.raises(KilnError) as e:
        parse_suite(data)
    return e.value


def with_example(change, index=0, **suite_overrides):
    data = suite_json(**suite_overrides)
    data["examples"] = copy.deepcopy(data["examples"])
    change(data["examples"][index])
    return data


def test_defaults_fill_omitted_settings():
    suite = parse_suite({"name": "s", "default_scorer": {"kind": "exact_match"},
                         "examples": [{"messages": [{"role": "user", "content": "hi"}]}]})
    assert suite.schema_version == 1
    assert suite.aggregation.kind == "single" and suite.k == 1
    g = suite.generation
    assert (g.temperature, g.top_p, g.top_k, g.max_tokens, g.n, g.stop, g.seed) == (0.0, 1.0, 0, 256, 1, [], None)
    ex = suite.examples[0]
    assert (ex.weight, ex.aliases, ex.tags, ex.target) == (1.0, [], [], None)


def test_unknown_fields_are_ignored():
    suite = parse_suite(suite_json(colour="red"))
    assert "colour" not in suite.to_json()


def test_example_id_is_derived_from_messages_target_and_aliases():
    messages = [{"role": "user", "content": "2+2?"}]
    # role, 0x00, content, 0x00, then "|t|" + target and "|a|" + each alias
    import hashlib

    expected = hashlib.sha256(b"user\x002+2?\x00|t|4|a|four").digest()[:8].hex()
    assert derive_example_id(messages, "4", ["four"]) == expected
    assert len(expected) == 16


def test_missing_and_empty_ids_resolve_to_derived_ids():
    data = with_example(lambda e: e.pop("id"))
    data["examples"][1]["id"] = ""
    ids = [r.id for r in resolve_examples(parse_suite(data))]
    assert ids == [derive_example_id([{"role": "user", "content": "2 + 2?"}], "4", []),
                   derive_example_id([{"role": "user", "content": "3 + 3?"}], "6", [])]


def test_system_prompt_is_prepended_unless_the_example_has_one():
    data = suite_json(system_prompt="Be brief.")
    data["examples"][1]["messages"] = [{"role": "system", "content": "Own."}, {"role": "user", "content": "3 + 3?"}]
    first, second = resolve_examples(parse_suite(data))
    assert first.messages[0] == {"role": "system", "content": "Be brief."}
    assert second.messages[0] == {"role": "system", "content": "Own."} and len(second.messages) == 2


def test_example_generation_replaces_the_suite_object_whole():
    data = suite_json(generation={"temperature": 0.7, "max_tokens": 64})
    data["examples"][0]["generation"] = {"max_tokens": 8}
    first, second = resolve_examples(parse_suite(data))
    assert (first.generation.scope, first.generation.params.temperature, first.generation.params.max_tokens) == (
        "example", 0.0, 8)
    assert (second.generation.scope, second.generation.params.temperature) == ("suite", 0.7)


def test_run_override_sits_between_example_and_suite():
    run = GenerationParams(max_tokens=5)
    (first, *_) = resolve_examples(parse_suite(suite_json()), run)
    assert (first.generation.scope, first.generation.params.max_tokens) == ("run_override", 5)


def test_thinking_budgets_keep_inherit_null_and_limit_apart():
    g = GenerationParams.model_validate({"thinking_budget_tokens": None, "thinking_budget_ms": 0})
    assert g.budget_override("thinking_budget_tokens") is None
    assert g.budget_override("thinking_budget_ms") == 0
    assert GenerationParams().budget_override("thinking_budget_tokens") == "inherit"


def test_seed_accepts_a_decimal_string():
    assert GenerationParams.model_validate({"seed": "18446744073709551615"}).seed == 2**64 - 1


def test_example_tools_override_suite_tools_and_empty_means_none():
    data = suite_json(tools=[{"type": "function", "function": {"name": "suite_tool"}}])
    data["examples"][0]["tools"] = [{"name": "own_tool"}]
    data["examples"][1]["tools"] = []
    first, second = resolve_examples(parse_suite(data))
    assert first.tools == [{"name": "own_tool"}]
    assert second.tools == []


def test_examples_without_tools_inherit_the_suite_tools():
    data = suite_json(tools=[{"name": "suite_tool"}])
    assert [r.tools for r in resolve_examples(parse_suite(data))] == [[{"name": "suite_tool"}]] * 2


def test_example_scorer_overrides_the_default():
    data = suite_json()
    data["examples"][0]["scorer"] = {"kind": "numeric_tolerance"}
    assert [r.scorer.kind for r in resolve_examples(parse_suite(data))] == ["numeric_tolerance", "exact_match"]


@pytest.mark.parametrize(
    ("change", "param", "fragment"),
    [
        (lambda e: e.update(weight=-1), "examples[1].weight", "example three-plus-three: weight:"),
        (lambda e: e.update(weight="heavy"), "examples[1].weight", "example three-plus-three: weight:"),
        (lambda e: e.update(messages=[]), "examples[1].messages", "example three-plus-three: messages:"),
        (lambda e: e.pop("messages"), "examples[1].messages", "example three-plus-three: messages:"),
        (lambda e: e.update(messages=[{"content": "no role"}]), "examples[1].messages[0].role",
         "example three-plus-three: messages[0].role:"),
        (lambda e: e.update(scorer={"kind": "nope"}), "examples[1].scorer", "example three-plus-three: scorer:"),
        (lambda e: e.update(generation={"n": 0}), "examples[1].generation.n", "example three-plus-three: generation.n:"),
        (lambda e: e.update(generation={"n": 2}), "examples[1].generation.n",
         "example three-plus-three: generation.n is 2, but it must equal aggregation k = 1"),
        (lambda e: e.update(id="two-plus-two"), "examples[1].id", "example two-plus-two: id: duplicates example #0"),
        (lambda e: e.update(id="   "), "examples[1].id", "example #1: id: must not be blank"),
        (lambda e: e.update(tools=[{"type": "function", "function": {}}]), "examples[1].tools[0]",
         "example three-plus-three: tools[0]:"),
        (lambda e: e.update(tools=["search"]), "examples[1].tools[0]", "example three-plus-three: tools[0]:"),
    ],
)
def test_example_errors_name_the_example_and_field(change, param, fragment):
    err = bad(with_example(change, index=1))
    assert (err.status, err.code, err.param) == (400, "eval_invalid_request", param)
    assert err.message.startswith("Invalid eval request: ")
    assert fragment in err.message


def test_example_without_id_is_named_by_position_when_it_fails_to_parse():
    err = bad(with_example(lambda e: (e.pop("id"), e.update(weight=-2)), index=1))
    assert "example #1: weight" in err.message


@pytest.mark.parametrize(
    ("overrides", "param", "fragment"),
    [
        ({"examples": []}, "examples", "at least one example"),
        ({"default_scorer": None}, "default_scorer", "default_scorer"),
        ({"schema_version": 3}, "schema_version", "schema_version"),
        ({"schema_version": True}, "schema_version", "schema_version"),
        ({"aggregation": {"kind": "pass_at_k", "k": 0}}, "aggregation.pass_at_k.k", "k"),
        ({"aggregation": {"kind": "pass_at_k", "k": 129}}, "aggregation.pass_at_k.k", "k"),
        ({"aggregation": {"kind": "single", "k": 1}}, "aggregation.single.k", "Extra inputs"),
        ({"aggregation": {"kind": "majority_at_k", "k": 4}, "generation": {"n": 4}}, "aggregation.k", "odd k"),
        ({"aggregation": {"kind": "mean_at_k", "k": 3}, "schema_version": 1, "generation": {"n": 3}},
         "aggregation", "schema_version 1"),
        ({"generation": {"n": 2}, "schema_version": 1}, "generation.n", "schema_version 1 requires n = 1"),
        ({"aggregation": {"kind": "mean_at_k", "k": 3}}, "generation.n", "must equal aggregation k = 3"),
        ({"tools": [{"function": {"name": ""}}]}, "tools[0]", "non-empty function.name"),
        ({"generation": {"temperature": float("nan")}}, "generation.temperature", "temperature"),
    ],
)
def test_suite_level_errors_name_the_field(overrides, param, fragment):
    err = bad(suite_json(**overrides))
    assert (err.code, err.param) == ("eval_invalid_request", param)
    assert fragment in err.message


@pytest.mark.parametrize("name", ["", "  ", "a/b", "a\\b", "x..y", ".."])
def test_bad_suite_names_are_rejected_with_their_own_code(name):
    err = bad(suite_json(name=name))
    assert (err.status, err.code, err.param) == (400, "invalid_suite_name", "name")


def test_k_completion_suite_is_valid_when_n_equals_k():
    suite = parse_suite(suite_json(aggregation={"kind": "majority_at_k", "k": 3}, generation={"n": 3}))
    assert suite.k == 3


def test_summary_counts_tags_sorted():
    summary = suite_summary(parse_suite(suite_json()))
    assert summary == {
        "name": "math-smoke", "description": "arithmetic", "num_examples": 2, "completions_per_example": 1,
        "aggregation": {"kind": "single"}, "schema_version": 2, "default_scorer_kind": "exact_match",
        "tags": {"easy": 1, "math": 2},
    }
    assert list(summary["tags"]) == ["easy", "math"]


def test_stored_form_round_trips_and_hashes_stably():
    suite = parse_suite(suite_json(generation={"seed": "7", "thinking_budget_ms": None}))
    again = parse_suite(suite.to_json())
    assert again.to_json() == suite.to_json()
    assert suite.to_json()["generation"] == {"seed": 7, "thinking_budget_ms": None}
    assert suite_hash(again) == suite_hash(suite)
    assert suite_hash(suite).startswith("sha256:") and len(suite_hash(suite)) == 71
