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
# ... except a step whose price a PrefillPacer set: its budget comes from measured step times, and a
# MIN_CHUNK floor would overrule it exactly where steps are slowest. On a Llama-3.2-1B-shaped Q4_K_M
# (2-core AMD EPYC Zen 4, AVX-512) 16 tokens deep in a 2000-token prompt cost more than the pacer's
# whole prefill share of a step with 8 decodes, and the floor, not the pacer, set the longest gaps
# (a third over the step's aim). A paced step still moves a prompt at least this far.
MIN_PACED_CHUNK = 4


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
