"""Domain-separated JSON digests for eval replay identity (semantics.md §8.13).

hash_json(domain, value) = "sha256:" + hex(SHA-256(domain || u64 LE length || json)), where json is
compact and keeps the objects' field order (Python dicts keep insertion order, so builders write
fields in the contract's order). The length prefix keeps two different (domain, json) splits apart.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

SUITE_DOMAIN = "kiln.eval-suite.v1\0"
EFFECTIVE_GENERATION_DOMAIN = "kiln.eval-effective-generation.v1\0"
SCORER_DOMAIN = "kiln.eval-scorer.v1\0"
RAW_COMPLETION_SET_DOMAIN = "kiln.eval-raw-completion-set.v1\0"
RECORD_DOMAIN = "kiln.eval-replay-record.v1\0"
# Not named by the notes; chosen in the same style.
EXECUTION_PROVENANCE_DOMAIN = "kiln.execution-provenance.v1\0"
BASE_WEIGHT_MANIFEST_DOMAIN = "kiln.base-weight-manifest.v1\0"

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def hash_json(domain: str, value: Any) -> str:
    body = compact_json(value)
    h = hashlib.sha256()
    h.update(domain.encode("utf-8"))
    h.update(struct.pack("<Q", len(body)))
    h.update(body)
    return "sha256:" + h.hexdigest()


def text_sha256(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST_RE.match(value) is not None
