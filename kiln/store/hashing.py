"""Content hashes as `sha256:<hex>` strings."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kiln.store.atomic import canonical_json


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_tagged(data: bytes) -> str:
    return "sha256:" + sha256_hex(data)


def sha256_json(obj: Any) -> str:
    """Hex sha256 over canonical JSON (sorted keys, compact separators)."""
    return sha256_hex(canonical_json(obj))


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
