"""Building outcomes from completions and a whole SuiteResult, checked against the contract schema."""

from datetime import UTC, datetime

import pytest

from kiln.evals.outcome import Completion, ExampleOutcome, apply_judge, build_outcome
from kiln.evals.result import aggregate_suite
from kiln.evals.seeds import derive_generation_seed
from kiln.evals.suite import parse_suite, resolve_examples, suite_hash
from kiln.testing.schemas import validate
from tests.evals._helpers import suite_json

SCHEMA = "kiln-evals-v1.schema.json"
TOOL_TARGET = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
START = datetime(2026, 7, 14, 12, 0, 0, tzinfo=UTC)
END = datetime(2026, 7, 14, 12, 0, 2, 500000, tzinfo=UTC)


def mixed_suite():
    data = suite_json(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {}}, "required": ["city"]}}}])
    data["examples"].append({"id": "weather", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                             "target": TOOL_TARGET, "scorer": {"kind": "tool_call"}, "tags": ["tools"],
                             "metadata": {"source": "unit"}})
    return parse_suite(data)


def test_build_outcome_normalizes_splits_and_scores():
    (ex, *_) = resolve_examples(mixed_suite())
    o = build_outcome(ex, 0, Completion("adding\n</think>\n\n4", latency_ms=12.5, prompt_tokens=9, completion_tokens=4),
                      prompt_starts_in_reasoning=True, generation_seed=derive_generation_seed(42, ex.id, 0))
    assert o.completion_text == "<think>\nadding\n</think>\n\n4"
    assert o.raw_completion_text == "adding\n</think>\n\n4"
    assert (o.kind, o.score, o.reasoning_text, o.unclosed_thinking) == ("pass", 1.0, "adding", False)
    wire = o.to_wire()
    validate(SCHEMA, "ExampleOutcome", wire)
    assert wire["generation_seed"] == str(derive_generation_seed(42, ex.id, 0))
    assert wire["tags"] == ["math"]


def test_generation_failure_is_an_error_outcome():
    (ex, *_) = resolve_examples(mixed_suite())
    o = build_outcome(ex, 0, Completion("", error="generation failed: out of memory"))
    assert (o.kind, o.score, o.detail) == ("error", 0.0, "generation failed: out of memory")
    validate(SCHEMA, "ExampleOutcome", o.to_wire())


def test_tool_outcome_carries_prediction_and_schema_evidence():
    *_, ex = resolve_examples(mixed_suite())
    o = build_outcome(ex, 0, Completion('{"name": "get_time", "arguments": {"zone": "UTC"}}'))
    assert o.predicted_tools == ("get_time",)
    assert o.kind == "fail" and "formats=[json_inline]" in o.detail


def test_judge_pass_can_be_deferred_and_applied_later():
    data = suite_json(default_scorer={"kind": "llm_judge"})
    (ex, *_) = resolve_examples(parse_suite(data))
    waiting = build_outcome(ex, 0, Completion("four"), defer_judge=True)
    assert (waiting.kind, waiting.detail) == ("invalid", "awaiting judge pass")
    judged = apply_judge(waiting, ex, lambda prompt: "Score: 1")
    assert (judged.kind, judged.score) == ("pass", 1.0)
    failed_gen = build_outcome(ex, 0, Completion("", error="generation failed: x"), defer_judge=True)
    assert apply_judge(failed_gen, ex, lambda prompt: "Score: 1") is failed_gen


def test_wire_round_trip_recovers_tool_evidence():
    *_, ex = resolve_examples(mixed_suite())
    o = build_outcome(ex, 0, Completion('<tool_call>\n<function=get_weather>\n<parameter=town>\nx\n</parameter>\n'
                                        '</function>\n</tool_call>'))
    back = ExampleOutcome.from_wire(o.to_wire())
    assert back == o


def test_aggregate_suite_produces_a_valid_suite_result():
    suite = mixed_suite()
    examples = resolve_examples(suite)
    texts = {"two-plus-two": "4", "three-plus-three": "<think>\nhmm\n</think>\n\n7",
             "weather": TOOL_TARGET}
    outcomes = [build_outcome(ex, 0, Completion(texts[ex.id], latency_ms=10.0 * (i + 1), prompt_tokens=8,
                                                completion_tokens=2),
                              generation_seed=derive_generation_seed(7, ex.id, 0))
                for i, ex in enumerate(examples)]
    result = aggregate_suite(suite, outcomes, adapter=None, started_at=START, finished_at=END, examples=examples)
    validate(SCHEMA, "SuiteResult", result)
    for entry in result["aggregated_outcomes"]:
        validate(SCHEMA, "AggregatedExampleOutcome", entry)
    validate(SCHEMA, "AggregateMetrics", result["metrics"])
    m = result["metrics"]
    assert (m["num_pass"], m["num_fail"], m["accuracy"]) == (2, 1, pytest.approx(2 / 3))
    assert m["pass_rate_by_tool"]["get_weather"]["num_pass"] == 1
    assert m["confusion_by_tool"] == {"get_weather": {"get_weather": 1}}
    assert m["elapsed_secs"] == 2.5
    assert result["started_at"] == "2026-07-14T12:00:00Z"
    assert result["suite_hash"] == suite_hash(suite)
    assert result["aggregated_outcomes"][2]["metadata"] == {"source": "unit"}


def test_k_completion_suite_result_is_valid():
    suite = parse_suite(suite_json(aggregation={"kind": "majority_at_k", "k": 3}, generation={"n": 3}))
    outcomes = [build_outcome(ex, i, Completion(text))
                for ex in resolve_examples(suite) for i, text in enumerate(["4", "6", "4"])]
    result = aggregate_suite(suite, outcomes, adapter="math-v1", started_at="2026-07-14T12:00:00Z",
                             finished_at="2026-07-14T12:00:01Z", elapsed_secs=1.0)
    validate(SCHEMA, "SuiteResult", result)
    assert [a["kind"] for a in result["aggregated_outcomes"]] == ["pass", "fail"]
    assert result["aggregated_outcomes"][1]["representative_completion_index"] == 0
    assert result["aggregation"] == {"kind": "majority_at_k", "k": 3}
    assert result["metrics"]["num_completions"] == 6
