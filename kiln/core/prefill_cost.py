"""How much prompt a step may prefill while decodes share it.

Prefill chunks are priced in token-equivalents: each token costs its projections (1) plus its
attention to every earlier position (position / ATTENTION_SPAN). A step that carries decodes gets a
fixed price budget, so a chunk deep into a long prompt is shorter than one at its start and the
decoding streams' inter-token gap stays bounded; a step without decodes keeps the whole token budget.
"""

from __future__ import annotations

# A token attending to this many earlier positions costs about as much again as its projections
# (measured on SmolLM2-135M with 2 CPU cores: ~1.2 ms per token at the start of a prompt, ~3.5 ms at
# position 1900).
ATTENTION_SPAN = 1024
# A step never moves a prompt forward by fewer tokens than this, however long its prefix.
MIN_CHUNK = 16


def chunk_cost(start: int, n: int, span: int = ATTENTION_SPAN) -> float:
    """Price of prefilling positions start .. start+n-1."""
    return n + (n * start + n * (n - 1) / 2) / span


def tokens_within(start: int, limit: int, cost: float, span: int = ATTENTION_SPAN) -> int:
    """The most tokens from `start` (at most `limit`) whose chunk_cost fits in `cost`."""
    lo, hi = 0, max(0, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_cost(start, mid, span) <= cost:
            lo = mid
        else:
            hi = mid - 1
    return lo
