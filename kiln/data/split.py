"""Deterministic, group-aware train/validation/holdout split (semantics.md §9.4).

Rows that share normalized content, a group_id or a session_id are joined (union-find) into one
component, and a component goes wholly to one partition, so near-duplicates and conversation
siblings never leak across the train/holdout boundary. The partition of a component depends only
on the seed and the component's smallest normalized hash, never on row order or on the machine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kiln.data.formats import invalid

SPLITS = ("train", "validation", "holdout")
SPLIT_SCHEMA = "kiln.dataset-split.v1"
ASSIGNMENT_DOMAIN = b"kiln.dataset-split-assignment.v1\0"
U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class SplitConfig:
    seed: int = 0
    train_percent: int = 80
    validation_percent: int = 10

    @property
    def holdout_percent(self) -> int:
        return 100 - self.train_percent - self.validation_percent

    def to_json(self) -> dict[str, Any]:
        return {"seed": str(self.seed), "train_percent": self.train_percent,
                "validation_percent": self.validation_percent}


@dataclass(frozen=True)
class RowIdentity:
    row_number: int  # 1-based over non-empty lines
    content_sha256: str
    normalized_sha256: str
    group_id: str | None = None
    session_id: str | None = None


def _int_field(data: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"split {key} must be an integer, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise invalid(f"split {key} must be between {lo} and {hi}, got {value}", param=key)
    return value


def _seed(value: Any) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit() and (value == "0" or value[0] != "0"):
        seed = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        seed = value
    else:
        raise invalid(f"split seed must be an unsigned 64-bit integer or its decimal string, got {value!r}",
                      param="seed")
    if not 0 <= seed <= U64_MAX:
        raise invalid(f"split seed must fit in 64 unsigned bits, got {value!r}", param="seed")
    return seed


def parse_split_config(data: Any) -> SplitConfig:
    """Validate a DatasetSplitConfig body; missing fields take the defaults (seed 0, 80/10)."""
    if not isinstance(data, dict):
        raise invalid("split config must be a JSON object", param="split_config")
    unknown = sorted(set(data) - {"seed", "train_percent", "validation_percent"})
    if unknown:
        raise invalid(f"unknown split config field(s): {', '.join(unknown)}", param=unknown[0],
                      hint="A split config has only seed, train_percent and validation_percent.")
    config = SplitConfig(
        seed=_seed(data.get("seed", 0)),
        train_percent=_int_field(data, "train_percent", 80, 1, 98),
        validation_percent=_int_field(data, "validation_percent", 10, 0, 98),
    )
    if config.train_percent + config.validation_percent >= 100:
        raise invalid("train_percent + validation_percent must be below 100 (holdout keeps at least 1%)",
                      param="validation_percent")
    return config


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:  # path compression
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def components(rows: list[RowIdentity]) -> list[list[int]]:
    """Row indices grouped by shared normalized content, group_id or session_id (transitively)."""
    uf = _UnionFind(len(rows))
    first_with: dict[str, int] = {}
    for i, row in enumerate(rows):
        keys = [f"normalized:{row.normalized_sha256}"]
        if row.group_id:
            keys.append(f"group:{row.group_id}")
        if row.session_id:
            keys.append(f"session:{row.session_id}")
        for key in keys:
            if key in first_with:
                uf.union(first_with[key], i)
            else:
                first_with[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(uf.find(i), []).append(i)
    return list(groups.values())


def bucket(seed: int, key: str) -> int:
    digest = hashlib.sha256(ASSIGNMENT_DOMAIN + seed.to_bytes(8, "big") + key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100


def assign_splits(rows: list[RowIdentity], config: SplitConfig) -> list[str]:
    """The partition of each row, in row order."""
    comps = components(rows)
    keyed = []
    for members in comps:
        key = min(rows[i].normalized_sha256 for i in members)
        keyed.append((bucket(config.seed, key), key, members))
    keyed.sort(key=lambda c: (c[0], c[1]))  # bucket, then key: independent of row order
    train_cut = config.train_percent
    val_cut = config.train_percent + config.validation_percent
    part = ["train" if b < train_cut else "validation" if b < val_cut else "holdout" for b, _, _ in keyed]
    _repair_small(part, config)
    out = [""] * len(rows)
    for (_, _, members), split in zip(keyed, part, strict=True):
        for i in members:
            out[i] = split
    return out


def _repair_small(part: list[str], config: SplitConfig) -> None:
    """Give every partition the config asks for at least one component when there are enough.

    `part` is the partition per component, components ordered by bucket ascending.
    """
    def count(split: str) -> int:
        return sum(1 for p in part if p == split)

    n = len(part)
    if n and count("train") == 0:
        part[0] = "train"
    if n >= 2 and config.holdout_percent > 0 and count("holdout") == 0:
        for i in range(n - 1, -1, -1):
            if count(part[i]) > 1:
                part[i] = "holdout"
                break
    if n >= 3 and config.validation_percent > 0 and count("validation") == 0:
        for i in range(n):
            if count(part[i]) > 1:
                part[i] = "validation"
                break


def split_counts(splits: list[str]) -> dict[str, int]:
    return {s: sum(1 for x in splits if x == s) for s in SPLITS}


def build_split_manifest(dataset_name: str, corpus: str, normalized_corpus: str, config: SplitConfig,
                         rows: list[RowIdentity], splits: list[str]) -> dict[str, Any]:
    entries = []
    for row, split in zip(rows, splits, strict=True):
        entry: dict[str, Any] = {
            "row_number": row.row_number,
            "content_sha256": row.content_sha256,
            "normalized_sha256": row.normalized_sha256,
            "split": split,
        }
        if row.group_id is not None:
            entry["group_id"] = row.group_id
        if row.session_id is not None:
            entry["session_id"] = row.session_id
        entries.append(entry)
    return {
        "schema": SPLIT_SCHEMA,
        "dataset_name": dataset_name,
        "corpus_sha256": corpus,
        "normalized_corpus_sha256": normalized_corpus,
        "config": config.to_json(),
        "counts": split_counts(splits),
        "rows": entries,
    }


def split_manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The persisted bytes of split.json; its sha256 is the manifest's split_manifest_sha256."""
    return (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
