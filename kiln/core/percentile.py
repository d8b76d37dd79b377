"""The percentile Kiln reports for what it served (per-request inter-token latencies, the decode
window): nearest rank, so every reported value is a latency that actually happened, whatever the
sample count (semantics.md's p50/p99 ITL). The benchmark suite's `interpolated_percentile`
(kiln/bench/stats.py) and the eval reports' `value_at_rounded_rank` (kiln/evals/stats.py) are other
conventions, named as such, kept because their archived results are compared with new ones."""

from __future__ import annotations

import math


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending list; None when empty."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]
