"""Eval seeds (semantics.md §8.9): one job seed, and a hash-derived seed per completion.

Deriving per completion (instead of `seed + i`) makes a completion's seed independent of suite order
and of which other examples a rerun selects, so a rerun of one example reproduces it byte for byte.
"""

from __future__ import annotations

import hashlib
import secrets
import struct

from kiln.errors import KilnError

SEED_DERIVATION = "kiln.eval-seed.v1"
U64_MAX = (1 << 64) - 1


def derive_generation_seed(seed_root: int, example_id: str, completion_index: int) -> int:
    id_bytes = example_id.encode("utf-8")
    h = hashlib.sha256()
    h.update(SEED_DERIVATION.encode("ascii"))
    h.update(b"\x00")
    h.update(struct.pack("<Q", seed_root & U64_MAX))
    h.update(struct.pack("<Q", len(id_bytes)))
    h.update(id_bytes)
    h.update(struct.pack("<Q", completion_index))
    return struct.unpack("<Q", h.digest()[:8])[0]


def parse_u64(value: object, *, param: str = "seed") -> int:
    """u64 JSON fields accept a number or a decimal string (JavaScript cannot hold every u64)."""
    if isinstance(value, bool):
        value = None  # a bool is never a seed; fall through to the error
    if isinstance(value, int):
        out = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() or isinstance(value, float) and value.is_integer():
        out = int(value)
    else:
        out = -1
    if not 0 <= out <= U64_MAX:
        raise KilnError(
            400,
            "eval_invalid_request",
            f"Invalid eval request: {param} must be an unsigned 64-bit integer (number or decimal string), got {value!r}",
            param=param,
            hint="Use a whole number from 0 to 18446744073709551615, e.g. 42 or \"42\".",
        )
    return out


def effective_job_seed(*candidates: int | None) -> int:
    """First set seed in precedence order (run/compare seed, run generation, suite generation), else random."""
    for seed in candidates:
        if seed is not None:
            return seed
    return secrets.randbits(64)


def seed_root_for(generation_seed: int | None, job_seed: int) -> int:
    """The effective generation object's own seed wins over the job seed."""
    return job_seed if generation_seed is None else generation_seed
