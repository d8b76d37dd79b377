"""What a dataset directory holds, written next to its data.jsonl in a staging directory.

split.json (kiln.dataset-split.v1), the three partition files, identity.json
(kiln.dataset-identity.v1) and manifest.json (DatasetManifest, schema_version 2) are all derived
from data.jsonl and the split config, so a create, a re-split and a manifest rebuild share this code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from kiln.data.identity import corpus_sha256, normalized_corpus_sha256
from kiln.data.ingest import ScanResult, iter_values
from kiln.data.split import SPLITS, SplitConfig, assign_splits, build_split_manifest, split_manifest_bytes
from kiln.store.atomic import atomic_write_bytes, atomic_write_json, fsync_path
from kiln.store.hashing import sha256_hex

SCHEMA_VERSION = 2
IDENTITY_SCHEMA = "kiln.dataset-identity.v1"
MANIFEST_KEYS = (
    "schema_version", "name", "format", "description", "num_rows", "size_bytes", "created_at", "updated_at",
    "corpus_sha256", "normalized_corpus_sha256", "split_manifest_sha256", "split_config", "split_counts",
    "num_groups", "num_sessions", "stats",
)


def materialize(staging: Path, name: str, result: ScanResult, description: str | None,
                 config: SplitConfig, created_at: str, updated_at: str) -> dict[str, Any]:
    """Write split, partitions, identity and manifest next to staging/data.jsonl."""
    rows = result.rows
    corpus = corpus_sha256(r.content_sha256 for r in rows)
    normalized = normalized_corpus_sha256(r.normalized_sha256 for r in rows)
    splits = assign_splits(rows, config)
    split_manifest = build_split_manifest(name, corpus, normalized, config, rows, splits)
    split_bytes = split_manifest_bytes(split_manifest)
    atomic_write_bytes(staging / "split.json", split_bytes)
    write_partitions(staging, result.fmt, splits)
    atomic_write_json(staging / "identity.json", {
        "schema": IDENTITY_SCHEMA,
        "dataset_name": name,
        "format": result.fmt,
        "num_rows": len(rows),
        "size_bytes": result.size_bytes,
        "data_sha256": result.data_sha256,
        "corpus_sha256": corpus,
        "normalized_corpus_sha256": normalized,
    })
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "format": result.fmt,
        "description": description,
        "num_rows": len(rows),
        "size_bytes": result.size_bytes,
        "created_at": created_at,
        "updated_at": updated_at,
        "corpus_sha256": corpus,
        "normalized_corpus_sha256": normalized,
        "split_manifest_sha256": "sha256:" + sha256_hex(split_bytes),
        "split_config": config.to_json(),
        "split_counts": split_manifest["counts"],
        "num_groups": len({r.group_id for r in rows if r.group_id}),
        "num_sessions": len({r.session_id for r in rows if r.session_id}),
        "stats": result.stats.to_json(),
    }
    atomic_write_json(staging / "manifest.json", manifest)
    return manifest


def write_partitions(staging: Path, fmt: str, splits: list[str]) -> None:
    files = {s: open(staging / f"{s}.jsonl", "wb") for s in SPLITS}  # noqa: SIM115
    try:
        for (line, _), split in zip(iter_values(staging / "data.jsonl", fmt), splits, strict=True):
            files[split].write(line + b"\n")
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    fsync_path(staging)


def link_or_copy(src: Path, dst: Path) -> None:
    """data.jsonl never changes in place, so a new generation can share its inode."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb") as f:
            os.fsync(f.fileno())
