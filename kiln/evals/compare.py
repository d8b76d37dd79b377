"""Paired comparison of runs over the same suite (semantics.md §8.8): flips and a sign test.

Runs are paired by stable example id over their aggregated outcomes. Each pair falls in one class:
both_pass, regressed (pass -> not pass), improved (not pass -> pass) or both_fail. The two-sided
exact sign test over the discordant pairs says whether the difference is more than chance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.evals.stats import sign_test_p_value

FlipClass = Literal["both_pass", "regressed", "improved", "both_fail"]
BASE_LABEL = "<base>"
SIGNIFICANCE = 0.05


def adapter_label(adapter: str | None) -> str:
    return adapter or BASE_LABEL


def flip_class(before: str, after: str) -> FlipClass:
    was, now = before == "pass", after == "pass"
    if was and now:
        return "both_pass"
    if was:
        return "regressed"
    return "improved" if now else "both_fail"


@dataclass(frozen=True)
class PairedComparison:
    baseline: str  # adapter labels
    candidate: str
    baseline_run: int
    candidate_run: int
    both_pass: int = 0
    regressed: int = 0
    improved: int = 0
    both_fail: int = 0
    flips: list[tuple[str, FlipClass]] = field(default_factory=list)  # regressed/improved example ids

    @property
    def num_paired(self) -> int:
        return self.both_pass + self.regressed + self.improved + self.both_fail

    @property
    def p_value(self) -> float:
        return sign_test_p_value(self.improved, self.regressed)

    @property
    def significant(self) -> bool:
        return self.p_value < SIGNIFICANCE

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "candidate": self.candidate, "baseline_run": self.baseline_run,
                "candidate_run": self.candidate_run, "num_paired": self.num_paired, "both_pass": self.both_pass,
                "regressed": self.regressed, "improved": self.improved, "both_fail": self.both_fail,
                "p_value": self.p_value, "significant": self.significant,
                "flips": [{"example_id": i, "class": c} for i, c in self.flips]}


def _kinds(run: Mapping[str, Any]) -> dict[str, str]:
    return {a["example_id"]: a["kind"] for a in run.get("aggregated_outcomes", [])}


def compare_pair(runs: Sequence[Mapping[str, Any]], baseline: int, candidate: int) -> PairedComparison:
    before, after = _kinds(runs[baseline]), _kinds(runs[candidate])
    counts: dict[FlipClass, int] = {"both_pass": 0, "regressed": 0, "improved": 0, "both_fail": 0}
    flips: list[tuple[str, FlipClass]] = []
    for example_id, kind in before.items():
        if example_id not in after:
            continue  # unpaired (e.g. a cancelled run kept fewer examples)
        cls = flip_class(kind, after[example_id])
        counts[cls] += 1
        if cls in ("regressed", "improved"):
            flips.append((example_id, cls))
    return PairedComparison(adapter_label(runs[baseline].get("adapter")), adapter_label(runs[candidate].get("adapter")),
                            baseline, candidate, flips=flips, **counts)


def compare_runs(runs: Sequence[Mapping[str, Any]]) -> list[PairedComparison]:
    """The first run is the baseline; every later run is compared with it."""
    return [compare_pair(runs, 0, i) for i in range(1, len(runs))]
