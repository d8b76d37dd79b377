"""Reducing k raw outcomes per example (semantics.md §8.6)."""

import pytest

from kiln.evals.aggregate import AggregationError, aggregate_example, aggregate_outcomes
from kiln.evals.outcome import ExampleOutcome
from kiln.evals.suite import MajorityAtK, MeanAtK, PassAtK, SingleAggregation


def raw(kinds_scores, example_id="e", tags=None):
    return [ExampleOutcome(example_id, i, "text", kind, score, tags=list(tags or []))
            for i, (kind, score) in enumerate(kinds_scores)]


def agg(aggregation, kinds_scores):
    return aggregate_example(aggregation, raw(kinds_scores))


def test_single_takes_completion_zero():
    a = agg(SingleAggregation(), [("invalid", 0.0)])
    assert (a.kind, a.score, a.completion_indices, a.representative_completion_index) == ("invalid", 0.0, [0], 0)
    assert (a.num_pass, a.num_fail, a.num_invalid, a.num_error) == (0, 0, 1, 0)


def test_mean_at_k_passes_at_half_and_picks_the_completion_closest_to_the_mean():
    a = agg(MeanAtK(k=3), [("fail", 0.2), ("pass", 0.6), ("pass", 0.9)])
    assert a.kind == "pass" and a.score == pytest.approx(17 / 30)
    assert a.representative_completion_index == 1


def test_mean_at_k_fails_below_half():
    a = agg(MeanAtK(k=2), [("fail", 0.0), ("pass", 0.8)])
    assert (a.kind, a.score) == ("fail", 0.4)


def test_mean_at_k_ties_go_to_the_lower_index():
    assert agg(MeanAtK(k=2), [("fail", 0.0), ("pass", 1.0)]).representative_completion_index == 0


def test_mean_at_k_without_pass_or_fail_uses_the_fallback_kind():
    assert agg(MeanAtK(k=2), [("error", 0.0), ("invalid", 0.0)]).kind == "invalid"
    assert agg(MeanAtK(k=2), [("error", 0.0), ("error", 0.0)]).kind == "error"


def test_pass_at_k_passes_on_any_pass_with_the_first_passing_representative():
    a = agg(PassAtK(k=3), [("fail", 0.1), ("pass", 0.9), ("pass", 1.0)])
    assert (a.kind, a.score, a.representative_completion_index) == ("pass", 1.0, 1)


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [(["fail", "invalid", "error"], "fail"), (["error", "invalid"], "invalid"), (["error", "error"], "error")],
)
def test_pass_at_k_fallback_prefers_fail_then_invalid_then_error(kinds, expected):
    a = agg(PassAtK(k=len(kinds)), [(k, 0.3) for k in kinds])
    assert (a.kind, a.score, a.representative_completion_index) == (expected, 0.0, 0)


def test_majority_at_k_needs_more_than_half():
    a = agg(MajorityAtK(k=3), [("fail", 0.0), ("pass", 1.0), ("pass", 1.0)])
    assert (a.kind, a.score, a.representative_completion_index) == ("pass", 1.0, 1)
    b = agg(MajorityAtK(k=3), [("pass", 1.0), ("invalid", 0.0), ("fail", 0.0)])
    assert (b.kind, b.score, b.representative_completion_index) == ("fail", 0.0, 1)


def test_groups_keep_first_appearance_order_and_sort_indices():
    outcomes = raw([("pass", 1.0)], "b") + raw([("fail", 0.0)], "a")
    assert [a.example_id for a in aggregate_outcomes(SingleAggregation(), outcomes)] == ["b", "a"]
    shuffled = list(reversed(raw([("fail", 0.0), ("pass", 1.0), ("pass", 1.0)])))
    assert aggregate_outcomes(PassAtK(k=3), shuffled)[0].representative_completion_index == 1


def test_incomplete_groups_are_rejected():
    with pytest.raises(AggregationError, match="indices"):
        aggregate_outcomes(PassAtK(k=3), raw([("pass", 1.0), ("pass", 1.0)]))
    dup = raw([("pass", 1.0)]) + raw([("pass", 1.0)])
    with pytest.raises(AggregationError):
        aggregate_outcomes(SingleAggregation(), dup)


def test_disagreeing_tags_or_bad_scores_are_rejected():
    outcomes = raw([("pass", 1.0), ("pass", 1.0)])
    outcomes[1] = ExampleOutcome("e", 1, "t", "pass", 1.0, tags=["other"])
    with pytest.raises(AggregationError, match="tags"):
        aggregate_outcomes(PassAtK(k=2), outcomes)
    bad = [ExampleOutcome("e", 0, "t", "pass", 1.0)]
    object.__setattr__(bad[0], "score", float("nan"))
    with pytest.raises(AggregationError, match="score"):
        aggregate_outcomes(SingleAggregation(), bad)


def test_wire_form_carries_tags_and_omits_absent_metadata():
    wire = aggregate_outcomes(SingleAggregation(), raw([("pass", 1.0)], tags=["math"]))[0].to_wire()
    assert wire["tags"] == ["math"] and "metadata" not in wire
