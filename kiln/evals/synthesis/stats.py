"""SynthesisStats: what the pipeline read, skipped, generated and kept (semantics.md §10.2)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SynthesisStats:
    effective_seed: int
    trajectories_seen: int = 0
    trajectories_used: int = 0
    examples_generated: int = 0
    skipped_no_target: int = 0
    skipped_prompt_too_long: int = 0
    skipped_target_too_long: int = 0
    skipped_duplicate: int = 0
    skipped_strategy_match: int = 0
    sample_kept: int = 0
    auto_scorer_histogram: Counter[str] = field(default_factory=Counter)

    def skip_summary(self) -> str:
        return (f"{self.trajectories_seen} conversation(s) read; skipped: {self.skipped_strategy_match} strategy "
                f"mismatch, {self.skipped_no_target} no target, {self.skipped_target_too_long} target too long, "
                f"{self.skipped_prompt_too_long} prompt too long, {self.skipped_duplicate} duplicate")

    def to_json(self) -> dict[str, Any]:
        return {
            "trajectories_seen": self.trajectories_seen,
            "trajectories_used": self.trajectories_used,
            "examples_generated": self.examples_generated,
            "skipped_no_target": self.skipped_no_target,
            "skipped_prompt_too_long": self.skipped_prompt_too_long,
            "skipped_target_too_long": self.skipped_target_too_long,
            "skipped_duplicate": self.skipped_duplicate,
            "skipped_strategy_match": self.skipped_strategy_match,
            "sample_kept": self.sample_kept,
            "effective_seed": str(self.effective_seed),
            "auto_scorer_histogram": dict(sorted(self.auto_scorer_histogram.items())),
        }
