"""Adapter content identity: `sha256:` over the two serving files, re-hashed only when they change.

Recipe (semantics.md §7.6 leaves the bytes open; this is Kiln's, version-tagged so it can evolve):
sha256( b"kiln-adapter-content-v1\\n"
        + for each of adapter_config.json, adapter_model.safetensors in that order:
              name + b"\\n" + decimal byte length + b"\\n" + the file's bytes )
The raw bytes are hashed, not a re-serialization: eval replay and rollout provenance promise byte
identity of what generated, and a re-formatted config is a different file.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

from kiln.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE

SERVING_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_DOMAIN = b"kiln-adapter-content-v1\n"
_CHUNK = 1 << 20

Signature = tuple[tuple[int, int, int], ...]


def file_signature(paths: list[Path]) -> Signature:
    """(size, mtime_ns, inode) per file: any rewrite, including an atomic replace, changes it."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _feed_file(h: hashlib._Hash, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)


def compute_content_hash(adapter_dir: Path) -> str:
    h = hashlib.sha256(_DOMAIN)
    for name in SERVING_FILES:
        path = adapter_dir / name
        h.update(name.encode() + b"\n" + str(path.stat().st_size).encode() + b"\n")
        _feed_file(h, path)
    return "sha256:" + h.hexdigest()


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    _feed_file(h, path)
    return "sha256:" + h.hexdigest()


class HashCache:
    """Memo of expensive per-path hashes keyed by the files' (size, mtime, inode) signature."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], tuple[Signature, str]] = {}

    def get(self, kind: str, key_path: Path, files: list[Path], compute: Callable[[], str]) -> str:
        sig = file_signature(files)
        ck = (kind, str(key_path))
        with self._lock:
            hit = self._entries.get(ck)
        if hit is not None and hit[0] == sig:
            return hit[1]
        value = compute()
        # A writer racing the hash would change the signature; only cache what we know we hashed.
        if file_signature(files) == sig:
            with self._lock:
                self._entries[ck] = (sig, value)
        return value

    def forget(self, key_path: Path) -> None:
        with self._lock:
            for ck in [k for k in self._entries if k[1] == str(key_path)]:
                del self._entries[ck]
