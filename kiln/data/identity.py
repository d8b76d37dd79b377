"""Content identity of dataset rows (semantics.md §9.3).

A row's identity is the sha256 of its canonical JSON; its normalized identity is the same after
every string value is whitespace-collapsed and lowercased, so "Hello  World" and "hello world"
collide and land in one split partition. Corpus hashes chain row identities with length prefixes,
so no two different row sequences share a corpus hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from kiln.store.atomic import canonical_json

CORPUS_DOMAIN = b"kiln.dataset-corpus.v1\0"
NORMALIZED_CORPUS_DOMAIN = b"kiln.dataset-normalized-corpus.v1\0"
IDENTITY_KEYS = ("metadata", "provenance", "extra")


def tagged(digest: bytes) -> str:
    return "sha256:" + digest.hex()


def normalize_text(text: str) -> str:
    """Split on Unicode whitespace, lowercase each piece, join with single spaces."""
    return " ".join(piece.lower() for piece in text.split())


def normalize_value(value: Any) -> Any:
    """`normalize_text` on every string value; keys, numbers, bools, nulls and order are kept."""
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, list):
        return [normalize_value(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize_value(v) for k, v in value.items()}
    return value


def content_sha256(value: Any) -> str:
    return tagged(hashlib.sha256(canonical_json(value)).digest())


def normalized_sha256(value: Any) -> str:
    return content_sha256(normalize_value(value))


def _chain(domain: bytes, identities: Iterable[str]) -> str:
    h = hashlib.sha256(domain)
    for identity in identities:
        data = identity.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return tagged(h.digest())


def corpus_sha256(content_identities: Iterable[str]) -> str:
    return _chain(CORPUS_DOMAIN, content_identities)


def normalized_corpus_sha256(normalized_identities: Iterable[str]) -> str:
    return _chain(NORMALIZED_CORPUS_DOMAIN, normalized_identities)


def example_identity(messages: Any, target: Any) -> tuple[str, str]:
    """(content, normalized) identity of an eval example built from a dataset row."""
    obj = {"messages": messages, "target": target}
    return content_sha256(obj), normalized_sha256(obj)


def _string_id(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def row_link_id(row: Any, key: str) -> str | None:
    """`group_id` / `session_id` of a row: the root field, else inside metadata, provenance, extra."""
    if not isinstance(row, dict):
        return None
    found = _string_id(row.get(key))
    if found is not None:
        return found
    for container in IDENTITY_KEYS:
        nested = row.get(container)
        if isinstance(nested, dict):
            found = _string_id(nested.get(key))
            if found is not None:
                return found
    return None
