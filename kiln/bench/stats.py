"""Summary statistics and ratio formatting shared by every measurement and the report."""

from __future__ import annotations

import math
from collections.abc import Sequence


def interpolated_percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default).

    None for no values: a measurement that produced nothing has no percentile, not a zero.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return float(ordered[lo])
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def median(values: Sequence[float]) -> float | None:
    return interpolated_percentile(values, 50.0)


def speedup(value: float | None, reference: float | None, higher_is_better: bool) -> float | None:
    """How many times better `value` is than `reference` (> 1 means better), whatever the metric's direction."""
    if value is None or reference is None or not math.isfinite(value) or not math.isfinite(reference):
        return None
    if value <= 0 or reference <= 0:
        return None
    return value / reference if higher_is_better else reference / value


def format_ratio(ratio: float | None) -> str:
    """`1.23x`, with more digits below 0.1x so that a small ratio never reads as `0.00x`."""
    if ratio is None:
        return "—"
    if ratio >= 100:
        return f"{ratio:.0f}x"
    if ratio >= 0.1:
        return f"{ratio:.2f}x"
    return f"{ratio:.3g}x"


def format_value(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"
