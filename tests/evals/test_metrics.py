"""AggregateMetrics over aggregated and raw outcomes (semantics.md §8.7), checked by hand."""

import pytest

from kiln.evals.aggregate import aggregate_outcomes
from kiln.evals.metrics import ExampleInfo, compute_metrics, latency_stats, reasoning_length_stats
from kiln.evals.outcome import ExampleOutcome
from kiln.evals.suite import PassAtK, SingleAggregation


def outcome(eid, kind, score, *, idx=0, tags=(), latency=0.0, tokens=(0, 0), reasoning=None, unclosed=False,
            detail="", tools=(), missing=0, extra=0):
    return ExampleOutcome(eid, idx, "t", kind, score, detail=detail, prompt_tokens=tokens[0],
                          completion_tokens=tokens[1], latency_ms=latency, tags=list(tags), reasoning_text=reasoning,
                          unclosed_thinking=unclosed, predicted_tools=tuple(tools), schema_missing_required=missing,
                          schema_extra_unknown=extra)


RAW = [
    outcome("e1", "pass", 1.0, tags=["math"], latency=10, tokens=(5, 1)),
    outcome("e2", "fail", 0.0, tags=["math", "hard"], latency=20, tokens=(6, 2), reasoning="hmm"),
    outcome("e3", "fail", 0.25, tags=["tools"], latency=40, tokens=(7, 3), detail="name=0.00 || formats=[json_inline]",
            tools=["get_time"], missing=1, extra=2),
    outcome("e4", "invalid", 0.0, latency=float("nan"), reasoning="", unclosed=True),
]
INFO = {
    "e1": ExampleInfo(weight=2.0, scorer_kind="exact_match"),
    "e2": ExampleInfo(weight=1.0, scorer_kind="exact_match"),
    "e3": ExampleInfo(weight=0.0, scorer_kind="tool_call", target_tool="get_weather"),
    "e4": ExampleInfo(weight=1.0, scorer_kind="tool_call", target_tool="get_weather"),
}


@pytest.fixture
def metrics():
    return compute_metrics(aggregate_outcomes(SingleAggregation(), RAW), RAW, INFO, elapsed_secs=1.5)


def test_counts_and_accuracy(metrics):
    assert {k: metrics[k] for k in ("num_examples", "num_completions", "num_pass", "num_fail", "num_invalid",
                                    "num_error")} == {"num_examples": 4, "num_completions": 4, "num_pass": 1,
                                                      "num_fail": 2, "num_invalid": 1, "num_error": 0}
    assert metrics["accuracy"] == 0.25
    assert metrics["accuracy_confidence_interval"]["lower"] == pytest.approx(0.045587, abs=1e-6)
    assert metrics["accuracy_confidence_interval"]["upper"] == pytest.approx(0.699358, abs=1e-6)


def test_mean_and_weighted_mean(metrics):
    assert metrics["mean_score"] == pytest.approx(1.25 / 4)
    # (1*2 + 0*1 + 0.25*0 + 0*1) / 4: the zero-weight example counts in the denominator only via its weight
    assert metrics["weighted_mean_score"] == pytest.approx(2 / 4)


def test_latency_ignores_non_finite_values(metrics):
    assert metrics["latency"] == {"p50_ms": 20.0, "p90_ms": 40.0, "p99_ms": 40.0, "mean_ms": pytest.approx(70 / 3),
                                  "max_ms": 40.0}


def test_token_totals_and_elapsed(metrics):
    assert (metrics["total_prompt_tokens"], metrics["total_completion_tokens"], metrics["elapsed_secs"]) == (18, 6, 1.5)


def test_tag_rates_and_breakdown(metrics):
    assert metrics["pass_rate_by_tag"] == {"hard": 0.0, "math": 0.5, "tools": 0.0}
    math = metrics["tag_breakdown"]["math"]
    assert (math["num_examples"], math["num_pass"], math["pass_rate"]) == (2, 1, 0.5)
    assert math["confidence_interval"]["lower"] == pytest.approx(0.094531, abs=1e-6)


def test_by_scorer(metrics):
    assert metrics["by_scorer"] == [
        {"scorer_kind": "exact_match", "num_examples": 2, "mean_score": 0.5, "pass_rate": 0.5},
        {"scorer_kind": "tool_call", "num_examples": 2, "mean_score": 0.125, "pass_rate": 0.0},
    ]


def test_tool_breakdown_and_confusion_use_target_and_representative_prediction(metrics):
    tool = metrics["pass_rate_by_tool"]["get_weather"]
    assert (tool["num_examples"], tool["num_pass"], tool["pass_rate"]) == (2, 0, 0.0)
    assert metrics["confusion_by_tool"] == {"get_weather": {"<none>": 1, "get_time": 1}}


def test_reasoning_and_format_counts(metrics):
    assert metrics["reasoning_length"] == {"num_with_thinking": 2, "mean_chars": 1.5, "p50_chars": 3,
                                           "p90_chars": 3, "max_chars": 3}
    assert metrics["num_unclosed_thinking"] == 1
    assert metrics["num_non_xml_tool_calls"] == 1
    assert (metrics["num_schema_missing_required"], metrics["num_schema_extra_unknown"]) == (1, 2)


def test_optional_maps_are_omitted_when_empty():
    raw = [outcome("x", "pass", 1.0)]
    m = compute_metrics(aggregate_outcomes(SingleAggregation(), raw), raw, {}, elapsed_secs=0.0)
    assert m["pass_rate_by_tag"] == {}
    assert not {"tag_breakdown", "pass_rate_by_tool", "confusion_by_tool"} & m.keys()


def test_empty_run_is_all_zero():
    m = compute_metrics([], [], {}, elapsed_secs=0.0)
    assert (m["accuracy"], m["mean_score"], m["weighted_mean_score"]) == (0.0, 0.0, 0.0)
    assert m["accuracy_confidence_interval"] == {"confidence_level": 0.95, "lower": 0.0, "upper": 0.0}


def test_all_zero_weights_give_zero_weighted_mean():
    raw = [outcome("x", "pass", 1.0)]
    m = compute_metrics(aggregate_outcomes(SingleAggregation(), raw), raw, {"x": ExampleInfo(weight=0.0)},
                        elapsed_secs=0.0)
    assert m["weighted_mean_score"] == 0.0


def test_latency_of_nothing_is_zeros():
    assert latency_stats([]) == {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0}


def test_reasoning_lengths_count_characters_not_bytes():
    raw = [outcome("x", "pass", 1.0, reasoning="héé")]
    assert reasoning_length_stats(raw)["max_chars"] == 3


def test_non_xml_count_skips_details_whose_format_list_starts_with_xml():
    raw = [outcome("a", "pass", 1.0, detail="x || formats=[xml,json_inline]"),
           outcome("b", "pass", 1.0, detail="x || formats=[fenced]")]
    m = compute_metrics(aggregate_outcomes(SingleAggregation(), raw), raw, {}, elapsed_secs=0.0)
    assert m["num_non_xml_tool_calls"] == 1


def test_raw_metrics_count_every_completion_of_a_k_run():
    raw = [outcome("a", "fail", 0.0, idx=0, latency=5, missing=1), outcome("a", "pass", 1.0, idx=1, latency=15)]
    m = compute_metrics(aggregate_outcomes(PassAtK(k=2), raw), raw, {}, elapsed_secs=0.0)
    assert (m["num_examples"], m["num_completions"], m["num_pass"]) == (1, 2, 1)
    assert m["latency"]["mean_ms"] == 10.0 and m["num_schema_missing_required"] == 1
