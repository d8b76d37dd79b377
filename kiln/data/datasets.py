"""The dataset store: named, content-addressed corpora split into train/validation/holdout.

Layout `<data_dir>/datasets/<name>/`: data.jsonl (the corpus, source of truth), split.json
(kiln.dataset-split.v1), identity.json (kiln.dataset-identity.v1), train.jsonl, validation.jsonl,
holdout.jsonl and manifest.json (DatasetManifest, schema_version 2). Every change builds a complete
new directory and swaps it in (kiln.store.dirswap), so a crash leaves the old or the new dataset.

Training and synthesis read partitions with `read_rows(name, split)` / `iter_rows(name, split)`.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, BinaryIO

from kiln.data.formats import CANONICAL_FORMATS, GRPO_GROUPS, RAW, SFT_CHAT, invalid, normalize_format
from kiln.data.ingest import ScanResult, ingest, iter_values, scan
from kiln.data.layout import MANIFEST_KEYS, SCHEMA_VERSION, link_or_copy, materialize
from kiln.data.split import SPLITS, SplitConfig, parse_split_config
from kiln.errors import KilnError
from kiln.store import dirswap
from kiln.store.atomic import store_root
from kiln.store.clock import utc_now_rfc3339
from kiln.store.locks import resource_lock
from kiln.store.names import name_problem
from kiln.store.sweep import sweep_named_folders

log = logging.getLogger("kiln.data")



def check_dataset_name(name: Any, param: str = "name") -> str:
    problem = name_problem(name)
    if problem:
        raise invalid(f"{param} {name!r} {problem}", param=param,
                      hint="Use one path segment without separators or '..', e.g. 'math-sft_v2'.")
    return name


def check_split(split: Any) -> str:
    if split not in SPLITS:
        raise invalid(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}", param="split")
    return split


class DatasetStore:
    def __init__(self, root: str | Path) -> None:
        self.root = store_root(root)
        if self.root.is_dir():
            self.recover_all()

    # ---- paths and locking -------------------------------------------------------------------

    def _available(self) -> None:
        if not self.root.is_dir():
            raise KilnError(503, "dataset_registry_unavailable",
                            f"the dataset store at {self.root} is not available",
                            hint="Check that [data] data_dir exists and is writable.")

    def _dir(self, name: str) -> Path:
        return self.root / check_dataset_name(name)

    def _lock(self, name: str, *, shared: bool = False):
        self._available()
        return resource_lock(self.root, name, shared=shared)

    def recover_all(self, *, wait: bool = True) -> None:
        """Settle what killed writers left behind (staging copies, half-done swaps).

        With `wait=False` a name whose lock is held is skipped: its scratch copy belongs to a
        writer that is alive and will clean up after itself.
        """
        for name in dirswap.scratch_names(self.root):
            with resource_lock(self.root, name, blocking=wait) as held:
                if held:
                    dirswap.recover(self.root, name)

    def sweep(self) -> list[str]:
        """Startup sweep: settle scratch copies of names no live writer holds, and stray temp files."""
        return sweep_named_folders(self.root)

    def _missing(self, name: str) -> KilnError:
        return KilnError(404, "dataset_not_found", f"dataset {name!r} not found", param="name",
                         hint="List datasets with GET /v1/eval/datasets.")

    # ---- create ------------------------------------------------------------------------------

    def create(self, name: str, source: bytes | BinaryIO, *, fmt: str | None = SFT_CHAT,
               description: str | None = None, split_config: SplitConfig | None = None) -> dict[str, Any]:
        """Validate and store a new dataset from JSONL or JSON-array bytes; returns its manifest."""
        check_dataset_name(name)
        fmt = normalize_format(fmt)
        description = description.strip() if description and description.strip() else None
        config = split_config or SplitConfig()
        src = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
        with self._lock(name):
            dirswap.recover(self.root, name)
            final = self.root / name
            if final.exists():
                raise self._exists(name)
            staging = dirswap.make_staging(self.root, name)
            try:
                result = ingest(src, fmt, staging / "data.jsonl")
                now = utc_now_rfc3339()
                manifest = materialize(staging, name, result, description, config, now, now)
                dirswap.publish_new(staging, final)
            except BaseException:
                dirswap.discard(staging)
                raise
        return manifest

    def create_rows(self, name: str, rows: list[Any], *, fmt: str = SFT_CHAT,
                    description: str | None = None) -> dict[str, Any]:
        data = b"".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for r in rows)
        return self.create(name, data, fmt=fmt, description=description)

    def _exists(self, name: str) -> KilnError:
        return KilnError(409, "dataset_exists", f"dataset {name!r} already exists", param="name",
                         hint="Pick another name, or DELETE /v1/eval/datasets/{name} first.")

    # ---- read --------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return (self._dir(name) / "manifest.json").exists() or (self._dir(name) / "data.jsonl").exists()

    def list(self) -> list[dict[str, Any]]:
        """Every dataset's manifest, most recently updated first."""
        self._available()
        self.recover_all(wait=False)
        out = []
        for entry in sorted(os.listdir(self.root)):
            if entry.startswith(".") or not (self.root / entry).is_dir():
                continue
            try:
                out.append(self.get(entry))
            except KilnError as e:
                log.warning("skipping dataset %s: %s", entry, e.message)
        out.sort(key=lambda m: (m["updated_at"], m["name"]), reverse=True)
        return out

    def get(self, name: str) -> dict[str, Any]:
        """The manifest; an old or damaged one is rebuilt from data.jsonl first."""
        path = self._dir(name)
        with self._lock(name, shared=True):
            manifest = self._read_manifest(name)
        if manifest is not None:
            return manifest
        with self._lock(name):
            dirswap.recover(self.root, name)
            if not path.is_dir():
                raise self._missing(name)
            return self._read_manifest(name) or self._rebuild(name)

    def _read_manifest(self, name: str) -> dict[str, Any] | None:
        """The stored manifest when current; None when it needs a rebuild. 404 when absent."""
        path = self.root / name
        if not path.is_dir():
            raise self._missing(name)
        try:
            manifest = json.loads((path / "manifest.json").read_text("utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict):
            return None
        version = manifest.get("schema_version")
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise KilnError(409, "dataset_invalid",
                            f"Invalid eval dataset: {name!r} has manifest schema_version {version}, newer than "
                            f"this server understands ({SCHEMA_VERSION})", param="name",
                            hint="Upgrade Kiln, or delete and re-upload the dataset.")
        if version != SCHEMA_VERSION or any(k not in manifest for k in MANIFEST_KEYS):
            return None
        return manifest

    def _rebuild(self, name: str) -> dict[str, Any]:
        final = self.root / name
        if not (final / "data.jsonl").exists():
            raise invalid(f"dataset {name!r} has no data.jsonl to rebuild its manifest from", param="name")
        old = _read_json(final / "manifest.json") or {}
        identity = _read_json(final / "identity.json") or {}
        fmt = old.get("format") or identity.get("format")
        try:
            config = parse_split_config(old.get("split_config", {}))
        except KilnError:
            config = SplitConfig()
        staging = dirswap.make_staging(self.root, name)
        try:
            link_or_copy(final / "data.jsonl", staging / "data.jsonl")
            result = _scan_any(staging / "data.jsonl", fmt)
            now = utc_now_rfc3339()
            manifest = materialize(staging, name, result, old.get("description"), config,
                                         old.get("created_at") or now, now)
            dirswap.replace(staging, final)
        except BaseException:
            dirswap.discard(staging)
            raise
        log.info("rebuilt manifest of dataset %s", name)
        return manifest

    def split_manifest(self, name: str) -> dict[str, Any]:
        self.get(name)
        with self._lock(name, shared=True):
            return json.loads((self._dir(name) / "split.json").read_text("utf-8"))

    def partition_count(self, name: str, split: str) -> int:
        return self.get(name)["split_counts"][check_split(split)]

    def iter_rows(self, name: str, split: str | None = None) -> Iterator[Any]:
        """Rows of the whole corpus (split None) or of one partition, parsed, in corpus order.

        The file is opened now, under the lock; a later split change swaps in a new directory
        without disturbing an iteration already under way.
        """
        if split is not None:
            check_split(split)
        fmt = self.get(name)["format"]
        file = "data.jsonl" if split is None else f"{split}.jsonl"
        with self._lock(name, shared=True):
            if not self._dir(name).is_dir():
                raise self._missing(name)
            f = open(self._dir(name) / file, "rb")  # noqa: SIM115
        return _iterate(f, fmt)

    def read_rows(self, name: str, split: str | None = None, *, limit: int | None = None,
                  nonempty: bool = False) -> list[Any]:
        """Parsed rows; `nonempty` makes an empty partition an error (training/synthesis never fall back)."""
        rows: list[Any] = []
        for value in self.iter_rows(name, split):
            if limit is not None and len(rows) >= limit:
                break
            rows.append(value)
        if nonempty and not rows:
            raise invalid(f"dataset {name!r} has no rows in its {split or 'whole'} partition", param="split",
                          hint="Change the split with PUT /v1/eval/datasets/{name}/split or pick another split.")
        return rows

    # ---- change ------------------------------------------------------------------------------

    def set_split(self, name: str, config: SplitConfig | dict[str, Any]) -> dict[str, Any]:
        """Re-split with a new config (atomically); returns the new split manifest."""
        if not isinstance(config, SplitConfig):
            config = parse_split_config(config)
        self.get(name)  # rebuilds an outdated manifest first
        final = self._dir(name)
        with self._lock(name):
            dirswap.recover(self.root, name)
            old = self._read_manifest(name)
            if old is None:
                raise invalid(f"dataset {name!r} changed while re-splitting; retry", param="name")
            staging = dirswap.make_staging(self.root, name)
            try:
                link_or_copy(final / "data.jsonl", staging / "data.jsonl")
                result = scan(staging / "data.jsonl", old["format"])
                materialize(staging, name, result, old["description"], config,
                                  old["created_at"], utc_now_rfc3339())
                dirswap.replace(staging, final)
            except BaseException:
                dirswap.discard(staging)
                raise
            return json.loads((final / "split.json").read_text("utf-8"))

    def delete(self, name: str) -> None:
        final = self._dir(name)
        with self._lock(name):
            dirswap.recover(self.root, name)
            if not final.is_dir():
                raise self._missing(name)
            dirswap.remove(final)


def _iterate(f: BinaryIO, fmt: str) -> Iterator[Any]:
    with f:
        for _, value in iter_values(f, fmt):
            yield value


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _scan_any(path: Path, fmt: str | None) -> ScanResult:
    """Scan with the recorded format, or with the first format that fits when none is recorded."""
    if fmt in CANONICAL_FORMATS:
        return scan(path, fmt)
    for candidate in (SFT_CHAT, GRPO_GROUPS):
        with suppress(KilnError):
            return scan(path, candidate)
    return scan(path, RAW)
