"""The post-training gate "paired_wilson_v1" (semantics.md §8.14): each step of the decision order on
hand-computed cases. Wilson bounds used below (z = 1.96, n = 20): 0/20 -> [0, 0.16113],
12/20 -> [0.38658, 0.78120], 20/20 -> [0.83887, 1]."""

from __future__ import annotations

import math

import pytest

from kiln.evals.gate import (
    ALPHA,
    MIN_PAIRED,
    GateThresholds,
    combine_outcomes,
    decide,
    gate_from_runs,
)

LO_20_20, UP_0_20 = 0.83887, 0.16113


def outcomes(passes: list[bool], scores: list[float] | None = None) -> list[dict]:
    scores = scores if scores is not None else [1.0 if p else 0.0 for p in passes]
    return [{"example_id": f"ex-{i}", "kind": "pass" if p else "fail", "score": s}
            for i, (p, s) in enumerate(zip(passes, scores, strict=True))]


def gate(base: list[bool], cand: list[bool], **thresholds):
    thresholds.setdefault("min_accuracy", 0.0)
    return decide(outcomes(base), outcomes(cand), GateThresholds(**thresholds))


def test_constants_are_the_documented_ones():
    assert MIN_PAIRED == 20 and ALPHA == 0.05


def test_fewer_than_twenty_pairs_is_inconclusive_even_when_every_pair_improves():
    d = gate([False] * 19, [True] * 19)
    assert d.outcome == "inconclusive" and d.evidence["num_paired"] == 19 and d.evidence["improved"] == 19
    assert "at least 20" in d.verdict


def test_a_significant_regression_comes_before_every_threshold():
    # 10 regressed, 0 improved: p = 2 / 2^10.
    d = gate([True] * 20, [True] * 10 + [False] * 10, min_accuracy=0.0)
    assert d.outcome == "regression"
    assert d.evidence["regressed"] == 10 and d.evidence["improved"] == 0
    assert d.evidence["p_value"] == pytest.approx(2 / 1024)


def test_a_candidate_whose_upper_bound_misses_min_accuracy_is_demoted():
    d = gate([False] * 20, [False] * 20, min_accuracy=0.5)
    assert d.outcome == "demoted"
    assert d.evidence["candidate_wilson"]["upper"] == pytest.approx(UP_0_20, abs=1e-5)
    assert d.evidence["p_value"] == 1.0


def test_a_candidate_whose_lower_bound_misses_min_accuracy_is_inconclusive():
    twelve = [True] * 12 + [False] * 8
    d = gate(twelve, twelve, min_accuracy=0.5)
    assert d.outcome == "inconclusive"
    ci = d.evidence["candidate_wilson"]
    assert ci["lower"] == pytest.approx(0.38658, abs=1e-5) and ci["upper"] == pytest.approx(0.78120, abs=1e-5)


def test_relative_recovery_is_judged_on_its_lower_bound():
    # Baseline and candidate both 20/20: lower bound = 0.83887 / 1.0, and no pair changed.
    ok = gate([True] * 20, [True] * 20, min_accuracy=0.5, relative_recovery=0.8)
    assert ok.outcome == "promoted" and ok.evidence["relative_recovery_lower_bound"] == pytest.approx(LO_20_20, abs=1e-5)
    short = gate([True] * 20, [True] * 20, min_accuracy=0.5, relative_recovery=0.9)
    assert short.outcome == "inconclusive" and "relative-recovery" in short.verdict


def test_absolute_gain_is_judged_on_its_lower_bound():
    # 0/20 -> 20/20: lower bound = 0.83887 - 0.16113 = 0.67774.
    ok = gate([False] * 20, [True] * 20, absolute_gain=0.5)
    assert ok.outcome == "promoted"
    assert ok.evidence["absolute_gain_lower_bound"] == pytest.approx(LO_20_20 - UP_0_20, abs=1e-5)
    assert gate([False] * 20, [True] * 20, absolute_gain=0.7).outcome == "inconclusive"


def test_both_optional_thresholds_must_hold():
    d = gate([False] * 20, [True] * 20, relative_recovery=1.0, absolute_gain=0.5)
    assert d.outcome == "promoted"  # 0.83887 / 0.16113 > 1 and 0.67774 >= 0.5
    assert gate([False] * 20, [True] * 20, relative_recovery=1.0, absolute_gain=0.9).outcome == "inconclusive"


def test_without_optional_thresholds_a_significant_improvement_passes():
    d = gate([False] * 20, [True] * 20, min_accuracy=0.5)
    assert d.outcome == "promoted" and d.evidence["p_value"] == pytest.approx(2 / 2**20)
    kept = gate([False] * 20, [True] * 20, min_accuracy=0.5, auto_load_on_pass=False)
    assert kept.outcome == "kept" and kept.evidence["decision"] == "pass"


def test_without_optional_thresholds_an_insignificant_improvement_is_inconclusive():
    d = gate([True] * 18 + [False] * 2, [True] * 20)  # 2 improved, 0 regressed: p = 0.5
    assert d.outcome == "inconclusive" and d.evidence["p_value"] == pytest.approx(0.5)


def test_improvement_compares_scores_while_accuracy_counts_passes():
    base = outcomes([False] * 20, [0.2] * 20)
    cand = outcomes([False] * 20, [0.6] * 20)
    d = decide(base, cand, GateThresholds(min_accuracy=0.0))
    assert d.evidence["improved"] == 20 and d.evidence["candidate_passes"] == 0
    assert d.outcome == "promoted"


def test_sign_test_matches_the_documented_example():
    base = outcomes([True] * 2 + [False] * 9 + [True] * 9)
    cand = outcomes([False] * 2 + [True] * 9 + [True] * 9)
    d = decide(base, cand, GateThresholds(min_accuracy=0.0))
    assert (d.evidence["improved"], d.evidence["regressed"]) == (9, 2)
    assert d.evidence["p_value"] == pytest.approx(134 / 2048)
    assert d.outcome == "inconclusive"  # p = 0.065 is not < 0.05


@pytest.mark.parametrize("break_it", ["duplicate", "missing", "nan"])
def test_unsound_evidence_fails_closed(break_it):
    base, cand = outcomes([True] * 20), outcomes([True] * 20)
    if break_it == "duplicate":
        cand[1]["example_id"] = cand[0]["example_id"]
    elif break_it == "missing":
        cand.pop()
    else:
        cand[3]["score"] = math.nan
    d = decide(base, cand, GateThresholds(min_accuracy=0.0))
    assert d.outcome == "error" and d.verdict.startswith("error:") and "not activated" in d.verdict


def test_runs_are_picked_by_adapter_and_a_missing_baseline_is_an_error():
    base, cand = outcomes([False] * 20), outcomes([True] * 20)
    job_runs = [{"adapter": None, "aggregated_outcomes": base}, {"adapter": "new", "aggregated_outcomes": cand}]
    d = gate_from_runs(job_runs, "new", GateThresholds(min_accuracy=0.5))
    assert d.outcome == "promoted"
    assert d.evidence["baseline_adapter"] is None and d.evidence["candidate_run_index"] == 1
    assert gate_from_runs(job_runs[1:], "new", GateThresholds(min_accuracy=0.5)).outcome == "error"


def test_the_evidence_carries_every_number_of_the_decision():
    d = gate([False] * 20, [True] * 20, min_accuracy=0.5, absolute_gain=0.1)
    ev = d.evidence
    for key in ("policy", "suite_policy", "min_paired", "alpha", "num_paired", "improved", "regressed",
                "unchanged", "baseline_passes", "candidate_passes", "p_value", "baseline_wilson",
                "candidate_wilson", "relative_recovery_lower_bound", "absolute_gain_lower_bound", "thresholds"):
        assert key in ev
    assert ev["thresholds"] == {"min_accuracy": 0.5, "absolute_gain": 0.1}
    assert ev["baseline_wilson"]["confidence_level"] == 0.95


def test_outcomes_combine_by_priority():
    assert combine_outcomes(["kept", "promoted"]) == "promoted"
    assert combine_outcomes(["promoted", "inconclusive"]) == "inconclusive"
    assert combine_outcomes(["regression", "demoted"]) == "regression"
    assert combine_outcomes(["demoted", "error", "kept"]) == "error"
    assert combine_outcomes([]) is None
