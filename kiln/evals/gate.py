"""The post-training eval gate, policy "paired_wilson_v1" (semantics.md §8.14). Pure: no torch, no I/O.

A candidate adapter and a baseline (the adapter served before training, or the base model) run the
same suite; their aggregated outcomes are paired by example id. Per pair, the aggregated SCORES say
whether the candidate improved or regressed; the pass counts give 95% Wilson intervals for both
accuracies. The p-value is the exact two-sided sign (binomial, p = 1/2) test over the discordant
pairs -- improved vs regressed, ties dropped -- the same test compare mode reports (§8.8).

Decision order, first match wins (MIN_PAIRED = 20, ALPHA = 0.05):
  1. fewer than 20 pairs                                   -> inconclusive
  2. regressed > improved and p < alpha                    -> regression
  3. candidate Wilson upper < min_accuracy                 -> demoted
  4. candidate Wilson lower < min_accuracy                 -> inconclusive
  5. relative_recovery set: candidate_lower / baseline_upper (1.0 when baseline_upper == 0) below it
                                                           -> inconclusive
  6. absolute_gain set: candidate_lower - baseline_upper below it -> inconclusive
  7. either optional threshold set (and met)               -> pass
  8. neither: improved > regressed and p < alpha           -> pass, else inconclusive
A pass is "promoted" with auto_load_on_pass, else "kept". Broken evidence (duplicate or missing
example ids, non-finite scores, no candidate or baseline run) is "error": the gate fails closed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.evals.stats import sign_test_p_value, wilson_interval

POLICY = "paired_wilson_v1"
SUITE_POLICY = "single_versioned_suite"
MIN_PAIRED = 20
ALPHA = 0.05
OUTCOMES = ("promoted", "kept", "regression", "demoted", "inconclusive", "error")
# Several gate evidences combine to the worst one (demoted and regression rank alike).
_PRIORITY = {"error": 4, "demoted": 3, "regression": 3, "inconclusive": 2, "promoted": 1, "kept": 0}


class GateEvidenceError(ValueError):
    """The runs cannot be paired soundly; the gate answers "error"."""


@dataclass(frozen=True)
class GateThresholds:
    min_accuracy: float
    relative_recovery: float | None = None
    absolute_gain: float | None = None
    auto_load_on_pass: bool = True

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"min_accuracy": self.min_accuracy}
        if self.relative_recovery is not None:
            out["relative_recovery"] = self.relative_recovery
        if self.absolute_gain is not None:
            out["absolute_gain"] = self.absolute_gain
        return out


@dataclass(frozen=True)
class GateDecision:
    outcome: str            # one of OUTCOMES
    verdict: str            # prose for people
    evidence: dict[str, Any]  # every number the decision used


def _scores(outcomes: Iterable[Mapping[str, Any]], which: str) -> dict[str, tuple[float, bool]]:
    out: dict[str, tuple[float, bool]] = {}
    for o in outcomes:
        example_id, score = o.get("example_id"), o.get("score")
        if not isinstance(example_id, str) or not example_id:
            raise GateEvidenceError(f"the {which} run has an outcome without an example id")
        if example_id in out:
            raise GateEvidenceError(f"the {which} run has example {example_id!r} twice")
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise GateEvidenceError(f"the {which} run's score for example {example_id!r} is not a finite number")
        out[example_id] = (float(score), o.get("kind") == "pass")
    return out


def paired_counts(baseline: Iterable[Mapping[str, Any]], candidate: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Pair aggregated outcomes by example id; both runs must hold exactly the same ids."""
    before, after = _scores(baseline, "baseline"), _scores(candidate, "candidate")
    missing = sorted(set(before) ^ set(after))
    if missing:
        raise GateEvidenceError(f"{len(missing)} example(s) are missing from one of the runs, e.g. {missing[0]!r}")
    improved = sum(1 for i, (b, _) in before.items() if after[i][0] > b)
    regressed = sum(1 for i, (b, _) in before.items() if after[i][0] < b)
    return {"num_paired": len(before), "improved": improved, "regressed": regressed,
            "unchanged": len(before) - improved - regressed,
            "baseline_passes": sum(p for _, p in before.values()),
            "candidate_passes": sum(p for _, p in after.values())}


def _fmt_ci(ci: Mapping[str, float]) -> str:
    return f"[{ci['lower']:.3f}, {ci['upper']:.3f}]"


def decide(baseline: Sequence[Mapping[str, Any]], candidate: Sequence[Mapping[str, Any]],
           thresholds: GateThresholds) -> GateDecision:
    """The gate over two runs' aggregated outcomes (AggregatedExampleOutcome dicts)."""
    base_evidence: dict[str, Any] = {"policy": POLICY, "suite_policy": SUITE_POLICY, "min_paired": MIN_PAIRED,
                                     "alpha": ALPHA, "thresholds": thresholds.to_dict(),
                                     "auto_load_on_pass": thresholds.auto_load_on_pass}
    try:
        counts = paired_counts(baseline, candidate)
    except GateEvidenceError as e:
        return error_decision(str(e), base_evidence)
    n, improved, regressed = counts["num_paired"], counts["improved"], counts["regressed"]
    p = sign_test_p_value(improved, regressed)
    base_ci = wilson_interval(counts["baseline_passes"], n).to_dict()
    cand_ci = wilson_interval(counts["candidate_passes"], n).to_dict()
    rr_lower = cand_ci["lower"] / base_ci["upper"] if base_ci["upper"] > 0 else 1.0
    ag_lower = cand_ci["lower"] - base_ci["upper"]
    t = thresholds
    decision, reason = _decide(n, improved, regressed, p, cand_ci, rr_lower, ag_lower, t)
    outcome = decision if decision != "pass" else ("promoted" if t.auto_load_on_pass else "kept")
    evidence = {
        **base_evidence, **counts, "p_value": p,
        "baseline_accuracy": counts["baseline_passes"] / n if n else 0.0,
        "candidate_accuracy": counts["candidate_passes"] / n if n else 0.0,
        "baseline_wilson": base_ci, "candidate_wilson": cand_ci,
        "relative_recovery_lower_bound": rr_lower, "absolute_gain_lower_bound": ag_lower,
        "decision": decision, "outcome": outcome, "reason": reason,
    }
    verdict = (f"{outcome}: {reason}. Candidate passed {counts['candidate_passes']}/{n} (95% Wilson "
               f"{_fmt_ci(cand_ci)}), baseline {counts['baseline_passes']}/{n} ({_fmt_ci(base_ci)}); "
               f"{improved} improved, {regressed} regressed, {counts['unchanged']} unchanged; "
               f"sign test p = {p:.4g}.")
    return GateDecision(outcome, verdict, evidence)


def _decide(n: int, improved: int, regressed: int, p: float, cand: Mapping[str, float], rr_lower: float,
            ag_lower: float, t: GateThresholds) -> tuple[str, str]:
    if n < MIN_PAIRED:
        return "inconclusive", f"only {n} paired example(s); the gate needs at least {MIN_PAIRED}"
    if regressed > improved and p < ALPHA:
        return "regression", f"the candidate regressed on {regressed} example(s) and improved on {improved} (p < {ALPHA})"
    if cand["upper"] < t.min_accuracy:
        return "demoted", f"the candidate's accuracy upper bound {cand['upper']:.3f} is below min_accuracy {t.min_accuracy}"
    if cand["lower"] < t.min_accuracy:
        return "inconclusive", (f"the candidate's accuracy lower bound {cand['lower']:.3f} does not reach "
                                f"min_accuracy {t.min_accuracy}")
    if t.relative_recovery is not None and rr_lower < t.relative_recovery:
        return "inconclusive", (f"the relative-recovery lower bound {rr_lower:.3f} does not reach "
                                f"relative_recovery {t.relative_recovery}")
    if t.absolute_gain is not None and ag_lower < t.absolute_gain:
        return "inconclusive", (f"the absolute-gain lower bound {ag_lower:.3f} does not reach "
                                f"absolute_gain {t.absolute_gain}")
    if t.relative_recovery is not None or t.absolute_gain is not None:
        return "pass", "min_accuracy and the configured recovery/gain thresholds are met at their lower bounds"
    if improved > regressed and p < ALPHA:
        return "pass", f"min_accuracy is met and the candidate improved significantly ({improved} vs {regressed}, p < {ALPHA})"
    return "inconclusive", (f"min_accuracy is met but the improvement is not significant ({improved} improved, "
                            f"{regressed} regressed, p = {p:.4g})")


def error_decision(message: str, evidence: Mapping[str, Any] | None = None) -> GateDecision:
    """Fail closed: the adapter stays on disk and is not activated."""
    out = {"policy": POLICY, **(evidence or {}), "outcome": "error", "reason": message}
    return GateDecision("error", f"error: {message}; the adapter was not activated.", out)


def gate_from_runs(runs: Sequence[Mapping[str, Any]], candidate: str, thresholds: GateThresholds) -> GateDecision:
    """Pick the candidate run (adapter == candidate) and the baseline run (the other one), then decide."""
    cand = [i for i, r in enumerate(runs) if r.get("adapter") == candidate]
    base = [i for i, r in enumerate(runs) if r.get("adapter") != candidate]
    if len(cand) != 1 or len(base) != 1:
        return error_decision(f"the eval job needs exactly one candidate run (adapter {candidate!r}) and one "
                              f"baseline run; it finished {len(cand)} and {len(base)}",
                              {"thresholds": thresholds.to_dict()})
    decision = decide(runs[base[0]].get("aggregated_outcomes", []), runs[cand[0]].get("aggregated_outcomes", []),
                      thresholds)
    decision.evidence.update(baseline_adapter=runs[base[0]].get("adapter"), candidate_adapter=candidate,
                             baseline_run_index=base[0], candidate_run_index=cand[0])
    return decision


def combine_outcomes(outcomes: Iterable[str]) -> str | None:
    """Several gate evidences aggregate to the worst: error > demoted = regression > inconclusive >
    promoted > kept (the first of equal rank wins). None for no outcomes."""
    worst: str | None = None
    for outcome in outcomes:
        if worst is None or _PRIORITY[outcome] > _PRIORITY[worst]:
            worst = outcome
    return worst
