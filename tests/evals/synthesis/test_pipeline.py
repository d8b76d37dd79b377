"""The synthesis pipeline (semantics.md §10.2): golden suites per strategy, counters, sampling, scorers."""

import hashlib
import json

import pytest

from kiln.data.identity import content_sha256
from kiln.errors import KilnError
from kiln.evals.suite import parse_suite
from kiln.evals.synthesis import parse_synthesize_body, synthesize
from kiln.store.atomic import canonical_json
from tests.evals.synthesis.corpus import SKY, corpus, numbered

WEATHER = '{"tool_calls":[{"arguments":{"city":"Paris"},"name":"get_weather"}]}'
SHELL = '{"tool_calls":[{"arguments":{"command":"ls /tmp"},"name":"run_shell"}]}'
CODE = "def add(a, b):\n    return a + b"
PARIS = "It is 21 degrees and sunny in Paris."
FILES = "There are two files: a.txt and b.txt."


def run(rows=None, **body):
    config = parse_synthesize_body({"suite_name": "golden", **body})
    return synthesize(corpus() if rows is None else rows, config, dataset="corpus", source_split="holdout")


def digest(suite_json):
    return hashlib.sha256(canonical_json(suite_json)).hexdigest()



# strategy -> (sha256 of the suite JSON for seed 7, [(target, scorer kind)], counters
#   (seen, used, generated, no_target, duplicate, strategy_mismatch))
GOLDEN = {
    "final_assistant": (
        "4fd4f73f881a28f006271a8089ca59ef121d250a1697c62b7848c47f229b727e",
        [("4", "numeric_tolerance"), ("B", "multiple_choice"), (PARIS, "exact_match"), (CODE, "code"),
         (SKY, "contains"), (FILES, "exact_match")],
        (9, 6, 6, 1, 1, 1)),
    "first_assistant_turn": (
        "07b70d7f102a9a4bb494ec9fd14332284d5d391c0d8a9ea0f531a57ac9cf2457",
        [("4", "numeric_tolerance"), ("B", "multiple_choice"), (WEATHER, "tool_call"), (CODE, "code"),
         ('{"name": "Ada"}', "json_validity"), (SHELL, "tool_call")],
        (9, 6, 6, 1, 1, 1)),
    "every_assistant_turn": (
        "6307bd7291c065c2e08fdeb9723d459a84b9dfe701ba8e88b240eb652a9505d7",
        [("4", "numeric_tolerance"), ("B", "multiple_choice"), (WEATHER, "tool_call"), (PARIS, "exact_match"),
         (CODE, "code"), ('{"name": "Ada"}', "json_validity"), (SKY, "contains"), (SHELL, "tool_call"),
         (FILES, "exact_match")],
        (9, 6, 9, 1, 1, 1)),
    "tool_call_predict": (
        "3a618a0592e5fe24bf9d1476d409585a7aa0557c05b6aa9e8caea77679d312e2",
        [(WEATHER, "tool_call"), (SHELL, "tool_call")],
        (9, 2, 2, 0, 0, 7)),
    "tool_response_followup": (
        "20adfc0115b93463c2a2fe8d7a38746723cf1dd1bdc40bd8c1b5c6aae7ab73a2",
        [(PARIS, "exact_match"), (FILES, "exact_match")],
        (9, 2, 2, 0, 0, 7)),
    "end_of_trajectory_answer": (
        "c284a65c820dd06a3c72537fc9069d1ffca8c2236dabd78a041fa8cae35f982e",
        [(PARIS, "exact_match"), (FILES, "exact_match")],
        (9, 2, 2, 0, 0, 7)),
}


@pytest.mark.parametrize("strategy", list(GOLDEN))
def test_golden_suite_per_strategy(strategy):
    sha, examples, counters = GOLDEN[strategy]
    result = run(strategy=strategy, sampling={"seed": 7})
    suite_json = result.suite_json()
    assert [(ex["target"], ex["scorer"]["kind"]) for ex in suite_json["examples"]] == examples
    s = result.stats
    assert (s.trajectories_seen, s.trajectories_used, s.examples_generated, s.skipped_no_target,
            s.skipped_duplicate, s.skipped_strategy_match) == counters
    assert s.sample_kept == len(examples)
    assert digest(suite_json) == sha


def test_golden_tool_call_predict_suite_in_full():
    rows = corpus()
    assert run(rows, strategy="tool_call_predict", sampling={"seed": 7}).suite_json() == {
        "name": "golden",
        "description": "Synthesized from dataset 'corpus' (holdout split) with strategy tool_call_predict: "
                       "2 example(s) kept of 2 generated from 2 of 9 trajectories; seed 7.",
        "default_scorer": {"kind": "exact_match", "case_sensitive": False, "strip_whitespace": True},
        "aggregation": {"kind": "single"},
        "examples": [
            {"messages": [{"role": "user", "content": "What's the weather in Paris?"}],
             "target": WEATHER,
             "tags": ["synth:tool_call_predict", "synth:turn_1", "kind:tool_call"],
             "metadata": {"synth_kind": "tool_call",
                          "kiln_dataset_provenance": {"dataset": "corpus", "source_split": "holdout",
                                                      "row_identity": content_sha256(rows[2])}},
             "scorer": {"kind": "tool_call", "name_match": {"kind": "case_insensitive"}, "args": {"kind": "auto"}},
             "weight": 1.0},
            {"messages": [{"role": "user", "content": "List the files in /tmp."}],
             "target": SHELL,
             "tags": ["synth:tool_call_predict", "synth:turn_1", "kind:tool_call"],
             "metadata": {"synth_kind": "tool_call",
                          "kiln_dataset_provenance": {"dataset": "corpus", "source_split": "holdout",
                                                      "row_identity": content_sha256(rows[5])}},
             "scorer": {"kind": "tool_call", "name_match": {"kind": "case_insensitive"}, "args": {"kind": "auto"}},
             "weight": 1.0},
        ],
        "schema_version": 2,
    }


def test_the_synthesized_suite_is_one_the_registry_accepts():
    result = run(strategy="every_assistant_turn", sampling={"seed": 7})
    assert parse_suite(json.loads(json.dumps(result.suite_json()))) == result.suite


def test_examples_carry_the_row_fields_kind_and_language_as_metadata():
    examples = run(sampling={"seed": 7}).suite_json()["examples"]
    assert examples[0]["metadata"]["group_id"] == "arith"
    assert examples[3]["metadata"]["synth_kind"] == "code"
    assert examples[3]["metadata"]["synth_language"] == "python"
    assert examples[3]["tags"] == ["synth:final_assistant", "kind:code", "synth:lang_python"]
    assert examples[4]["metadata"]["metadata"] == {"source": "science"}


def test_strip_system_prompt_drops_system_messages_from_prompts():
    kept = run(strip_system_prompt=True, sampling={"seed": 7}).suite_json()["examples"][0]["messages"]
    assert kept == [{"role": "user", "content": "What is 2 + 2?"}]


def test_system_prompt_and_suite_tools_go_on_the_suite():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    suite = run(system_prompt="Be brief.", suite_tools=tools, sampling={"seed": 7}).suite
    assert (suite.system_prompt, suite.tools) == ("Be brief.", tools)


def test_a_fixed_scorer_is_the_default_and_examples_carry_none():
    result = run(scorer={"kind": "fixed", "scorer": {"kind": "contains", "phrases": ["Paris"]}}, sampling={"seed": 7})
    suite_json = result.suite_json()
    assert suite_json["default_scorer"] == {"kind": "contains", "phrases": ["Paris"]}
    assert all("scorer" not in ex for ex in suite_json["examples"])
    assert result.stats.auto_scorer_histogram == {"contains": 6}
    assert suite_json["examples"][1]["target"] == "(B)"  # only auto-detection rewrites choice targets


def test_a_judge_scorer_is_llm_judge_with_the_chosen_adapter():
    result = run(scorer={"kind": "judge", "judge_adapter": "grader"}, sampling={"seed": 7})
    assert result.suite_json()["default_scorer"] == {"kind": "llm_judge", "judge_adapter": "grader"}
    assert result.suite.default_scorer.template.startswith("You are a strict grader")
    assert result.stats.auto_scorer_histogram == {"llm_judge": 6}


def test_auto_detect_defaults_to_case_insensitive_exact_match():
    result = run(sampling={"seed": 7})
    assert result.suite_json()["default_scorer"] == {"kind": "exact_match", "case_sensitive": False,
                                                     "strip_whitespace": True}
    assert result.stats.to_json()["auto_scorer_histogram"] == {
        "code": 1, "contains": 1, "exact_match": 2, "multiple_choice": 1, "numeric_tolerance": 1}


def test_generation_n_follows_the_aggregation_k():
    suite = run(aggregation={"kind": "pass_at_k", "k": 3}, generation={"temperature": 0.7}, sampling={"seed": 1}).suite
    assert (suite.k, suite.generation.n, suite.generation.temperature) == (3, 3, 0.7)
    assert run(aggregation={"kind": "mean_at_k", "k": 4}, sampling={"seed": 1}).suite.generation.n == 4


def test_an_explicit_n_that_contradicts_k_is_a_400_on_generation_n():
    with pytest.raises(KilnError) as e:
        run(aggregation={"kind": "pass_at_k", "k": 3}, generation={"n": 2})
    assert (e.value.status, e.value.code, e.value.param) == (400, "eval_invalid_request", "generation.n")


def test_an_even_majority_is_a_400_on_aggregation_k():
    with pytest.raises(KilnError) as e:
        run(aggregation={"kind": "majority_at_k", "k": 2})
    assert e.value.param == "aggregation.k"


def test_without_a_sampling_object_at_most_100_examples_are_kept():
    result = run(numbered(150))
    assert (result.stats.examples_generated, result.stats.sample_kept) == (150, 100)


def test_a_sampling_object_without_max_examples_keeps_everything():
    assert run(numbered(150), sampling={}).stats.sample_kept == 150


def test_same_seed_gives_the_identical_suite():
    first = run(numbered(40), sampling={"max_examples": 5, "seed": 11}).suite_json()
    second = run(numbered(40), sampling={"max_examples": 5, "seed": 11}).suite_json()
    assert first == second


def test_a_different_seed_gives_a_different_sample_when_sampling_applies():
    def targets(seed):
        return [ex["target"] for ex in run(numbered(40), sampling={"max_examples": 5, "seed": seed}).suite_json()["examples"]]

    assert targets(11) != targets(12)
    assert len(targets(11)) == 5


def test_the_seed_does_not_matter_when_everything_fits():
    def examples(seed):
        return run(numbered(5), sampling={"max_examples": 5, "seed": seed}).suite_json()["examples"]

    assert examples(1) == examples(2)
    assert [ex["target"] for ex in examples(1)] == [f"Answer {i}" for i in range(5)]


def test_without_a_seed_the_effective_seed_comes_from_the_clock_and_is_reported():
    config = parse_synthesize_body({"suite_name": "golden"})
    result = synthesize(corpus(), config, dataset="corpus", source_split="holdout", clock_ns=lambda: 1234)
    assert result.stats.effective_seed == run(sampling={"seed": result.stats.effective_seed}).stats.effective_seed
    assert result.stats.to_json()["effective_seed"] == str(result.stats.effective_seed)
    assert result.stats.effective_seed != 1234  # mixed with the suite name


def test_targets_over_max_target_chars_are_skipped():
    s = run(sampling={"seed": 1, "max_target_chars": 10}).stats
    assert (s.skipped_target_too_long, s.examples_generated) == (4, 2)


def test_prompts_over_max_prompt_chars_are_skipped():
    # "What is 2 + 2?" as a user turn counts 14 + 4 + 4 = 22 characters.
    s = run(numbered(3) + [{"messages": [{"role": "user", "content": "x" * 30},
                                         {"role": "assistant", "content": "y"}]}],
            sampling={"seed": 1, "max_prompt_chars": 22}).stats
    assert (s.skipped_prompt_too_long, s.examples_generated) == (1, 3)


def test_dedupe_off_keeps_repeats_under_distinct_ids():
    result = run(numbered(2) * 2, sampling={"seed": 7, "dedupe": False})
    assert result.stats.skipped_duplicate == 0 and result.stats.sample_kept == 4
    ids = [ex.id for ex in result.suite.examples]
    assert ids[:2] == [None, None]
    assert ids[2] is not None and ids[2].endswith("-2")


def test_dedupe_drops_a_repeated_question_and_target():
    s = run(numbered(2) * 2, sampling={"seed": 7}).stats
    assert (s.skipped_duplicate, s.sample_kept, s.trajectories_used) == (2, 2, 2)


def test_max_conversations_bounds_what_is_read():
    s = run(numbered(10), sampling={"seed": 1}).stats
    config = parse_synthesize_body({"suite_name": "golden", "sampling": {"seed": 1}})
    head = synthesize(numbered(10), config, dataset="d", source_split="holdout", max_conversations=3).stats
    assert (s.trajectories_seen, head.trajectories_seen, head.sample_kept) == (10, 3, 3)


def test_a_user_description_comes_before_the_generated_line():
    description = run(description="Weather regressions", sampling={"seed": 7}).suite.description
    assert description.startswith("Weather regressions\n\nSynthesized from dataset 'corpus' (holdout split)")


def test_no_examples_is_a_400_dataset_invalid_with_the_counters():
    with pytest.raises(KilnError) as e:
        run([{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
            strategy="tool_call_predict")
    assert (e.value.status, e.value.code) == (400, "dataset_invalid")
    assert "synthesis produced no examples" in e.value.message and "1 strategy mismatch" in e.value.message
