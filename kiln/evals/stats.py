"""Interval and test statistics for pass rates (semantics.md §8.8)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

Z_95 = 1.959963984540054


@dataclass(frozen=True)
class ConfidenceInterval:
    confidence_level: float
    lower: float
    upper: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def wilson_interval(passes: int, n: int) -> ConfidenceInterval:
    """Wilson score interval at 95%: well-behaved at 0/n and n/n, unlike the normal approximation."""
    if n <= 0:
        return ConfidenceInterval(0.95, 0.0, 0.0)
    z2 = Z_95 * Z_95
    p = passes / n
    denom = 1.0 + z2 / n
    center = p + z2 / (2.0 * n)
    margin = Z_95 * math.sqrt((p * (1.0 - p) + z2 / (4.0 * n)) / n)
    lower = _clamp01((center - margin) / denom)
    upper = _clamp01((center + margin) / denom)
    # Exactly 0 and 1 at the edges, where the formula's terms cancel only up to rounding.
    return ConfidenceInterval(0.95, 0.0 if passes == 0 else lower, 1.0 if passes == n else upper)


def sign_test_p_value(improved: int, regressed: int) -> float:
    """Two-sided exact sign test over discordant pairs, summed in log space so large n cannot overflow."""
    n = improved + regressed
    if n == 0:
        return 1.0
    k = min(improved, regressed)
    log_half_n = n * math.log(0.5)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half_n for i in range(k + 1)]
    top = max(terms)
    log_tail = top + math.log(sum(math.exp(t - top) for t in terms))
    return min(1.0, 2.0 * math.exp(log_tail))


def round_half_away(x: float) -> int:
    """Rust's f64::round (Python's round() is banker's rounding)."""
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def value_at_rounded_rank(sorted_values: list[float], q: float) -> float:
    """Value at index round(q * (n - 1)) of an ascending list; 0 for an empty one."""
    if not sorted_values:
        return 0.0
    return sorted_values[round_half_away(q * (len(sorted_values) - 1))]
