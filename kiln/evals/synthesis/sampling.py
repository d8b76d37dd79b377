"""Seeded, portable sampling: the effective seed, a SplitMix64 stream and a reservoir (semantics.md §10.2).

Rust's SmallRng draws cannot be reproduced outside Rust, so Kiln pins its own generator: SplitMix64
(Steele, Lea and Flood 2014) is a few lines of 64-bit arithmetic any language can repeat, which
keeps a suite synthesized with a given seed identical across machines and implementations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

U64_MASK = (1 << 64) - 1
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

T = TypeVar("T")


def fnv1a64(text: str) -> int:
    h = FNV_OFFSET
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * FNV_PRIME) & U64_MASK
    return h


def effective_seed(seed: int | None, suite_name: str, clock_ns: Callable[[], int] = time.time_ns) -> int:
    """The request's seed, else the clock mixed with the suite name (reported so a run can be repeated)."""
    if seed is not None:
        return seed
    return (clock_ns() ^ fnv1a64(suite_name)) & U64_MASK


class SplitMix64:
    def __init__(self, seed: int) -> None:
        self.state = seed & U64_MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & U64_MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64_MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64_MASK
        return z ^ (z >> 31)


class Reservoir(Generic[T]):
    """Algorithm R: a uniform sample of at most `cap` items from a stream of unknown length.

    The generator is drawn only once the reservoir is full, so a stream that fits keeps every item in
    arrival order whatever the seed. `cap` None keeps everything.
    """

    def __init__(self, cap: int | None, rng: SplitMix64) -> None:
        self.cap = cap
        self.rng = rng
        self.items: list[T] = []
        self.offered = 0

    def offer(self, item: T) -> None:
        self.offered += 1
        if self.cap is None or len(self.items) < self.cap:
            self.items.append(item)
            return
        r = self.rng.next_u64() % self.offered
        if r < self.cap:
            self.items[r] = item
