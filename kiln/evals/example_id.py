"""Stable ids for examples that have none (semantics.md §8.2)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from kiln.core.messages import message_text


def derive_example_id(messages: Iterable[dict[str, Any]], target: str | None, aliases: Iterable[str]) -> str:
    """16 hex chars of SHA-256 over role/content pairs, target and aliases: same example, same id."""
    h = hashlib.sha256()
    for msg in messages:
        h.update(str(msg.get("role", "")).encode("utf-8"))
        h.update(b"\x00")
        h.update(message_text(msg.get("content")).encode("utf-8"))
        h.update(b"\x00")
    if target is not None:
        h.update(b"|t|" + target.encode("utf-8"))
    for alias in aliases:
        h.update(b"|a|" + alias.encode("utf-8"))
    return h.digest()[:8].hex()


def resolve_example_id(explicit: str | None, messages: Iterable[dict[str, Any]], target: str | None,
                       aliases: Iterable[str]) -> str:
    if explicit:
        return explicit
    return derive_example_id(messages, target, aliases)
