"""The judgment store: append-only pairwise preference sets (semantics.md §11.1).

Layout `<data_dir>/judgments/<name>/`: judgments.jsonl (one row per line, appended and fsynced
before the append is acknowledged) and manifest.json. Row counts, the winner histogram and
updated_at are derived from judgments.jsonl on every read, so a crash between the append and the
manifest rewrite loses nothing; manifest.json keeps description, timestamps and the compile split.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import suppress
from pathlib import Path
from typing import Any

from kiln.data.datasets import DatasetStore, check_dataset_name
from kiln.data.judgment_compile import CompilePlan, plan_compile
from kiln.data.judgment_rows import JudgmentRow, judgment_invalid, row_from_body
from kiln.data.preferences import EXPORT_FORMATS, JudgmentPairs, export_rows, pairs_from_judgments
from kiln.errors import KilnError
from kiln.store import dirswap
from kiln.store.atomic import append_jsonl, atomic_write_bytes, atomic_write_json, read_jsonl, store_root
from kiln.store.clock import utc_now_rfc3339
from kiln.store.locks import resource_lock
from kiln.store.names import name_problem
from kiln.store.sweep import sweep_named_folders

log = logging.getLogger("kiln.data")

ROWS_FILE = "judgments.jsonl"
MANIFEST_FILE = "manifest.json"
HISTOGRAM_ORDER = ("a", "b", "tie", "skip")


def check_judgment_name(name: Any, *, creating: bool = False) -> str:
    problem = name_problem(name)
    if problem and creating:
        # Creating a judgment set reports bad names as dataset_invalid (semantics.md §7.3).
        raise KilnError(400, "dataset_invalid", f"Invalid eval dataset: judgment name {name!r} {problem}",
                        param="name", hint="Use one path segment without separators or '..'.")
    if problem:
        raise judgment_invalid(f"name {name!r} {problem}", param="name",
                               hint="Use one path segment without separators or '..'.")
    return name


class JudgmentStore:
    def __init__(self, root: str | Path) -> None:
        self.root = store_root(root)
        if self.root.is_dir():
            for name in dirswap.scratch_names(self.root):
                with resource_lock(self.root, name):
                    dirswap.recover(self.root, name)

    def sweep(self) -> list[str]:
        """Startup sweep: scratch copies of names no live writer holds, and temp files of in-place rewrites."""
        return sweep_named_folders(self.root)

    def _lock(self, name: str, *, shared: bool = False):
        if not self.root.is_dir():
            raise KilnError(503, "judgment_store_unavailable", f"the judgment store at {self.root} is not available",
                            hint="Check that [data] data_dir exists and is writable.")
        return resource_lock(self.root, name, shared=shared)

    def _existing(self, name: str) -> Path:
        path = self.root / name
        if not path.is_dir():
            raise KilnError(404, "judgment_not_found", f"judgment set {name!r} not found", param="name",
                            hint="List judgment sets with GET /v1/judgments.")
        return path

    # ---- reading -----------------------------------------------------------------------------

    def _rows(self, path: Path) -> list[JudgmentRow]:
        rows = []
        for value in read_jsonl(path / ROWS_FILE, skip_invalid=True):
            try:
                rows.append(JudgmentRow.from_json(value))
            except (KeyError, TypeError, AttributeError):
                log.warning("skipping malformed judgment row in %s", path)
        return rows

    def _manifest(self, name: str, path: Path, rows: list[JudgmentRow],
                  meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The manifest as clients see it: stored metadata plus counts derived from the rows."""
        meta = _read_json(path / MANIFEST_FILE) if meta is None else meta
        created = meta.get("created_at") or (rows[0].submitted_at if rows else utc_now_rfc3339())
        updated = max([meta.get("updated_at") or created] + [r.submitted_at for r in rows])
        histogram: dict[str, int] = {}
        for row in rows:
            histogram[row.winner] = histogram.get(row.winner, 0) + 1
        out: dict[str, Any] = {
            "name": name,
            "description": meta.get("description"),
            "num_rows": len(rows),
            "created_at": created,
            "updated_at": updated,
            "winner_histogram": {k: histogram[k] for k in HISTOGRAM_ORDER if k in histogram},
        }
        for key in ("last_compiled_split", "last_compiled_at"):
            if meta.get(key) is not None:
                out[key] = meta[key]
        return out

    def get(self, name: str) -> dict[str, Any]:
        check_judgment_name(name)
        with self._lock(name, shared=True):
            path = self._existing(name)
            return self._manifest(name, path, self._rows(path))

    def rows(self, name: str) -> list[dict[str, Any]]:
        check_judgment_name(name)
        with self._lock(name, shared=True):
            return [r.to_json() for r in self._rows(self._existing(name))]

    def preference_pairs(self, name: str) -> JudgmentPairs:
        """The set's A/B rows as preference pairs (ties and skips counted): what DPO trains on."""
        check_judgment_name(name)
        with self._lock(name, shared=True):
            return pairs_from_judgments(name, self._rows(self._existing(name)))

    def export(self, name: str, fmt: str) -> tuple[bytes, JudgmentPairs]:
        """Preference JSONL of the set's A/B rows in TRL's or OpenAI's DPO format, and the pairs."""
        if fmt not in EXPORT_FORMATS:
            raise judgment_invalid(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}", param="format",
                                   hint="trl: {prompt, chosen, rejected} (conversational); openai: {input, "
                                        "preferred_output, non_preferred_output}.")
        found = self.preference_pairs(name)
        lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in export_rows(found.pairs, fmt)]
        return "".join(lines).encode("utf-8"), found

    def list(self) -> list[dict[str, Any]]:
        if not self.root.is_dir():
            self._lock("_")  # raises the 503
        out = []
        for entry in sorted(os.listdir(self.root)):
            if entry.startswith(".") or not (self.root / entry).is_dir():
                continue
            with suppress(KilnError):
                out.append(self.get(entry))
        out.sort(key=lambda m: (m["updated_at"], m["name"]), reverse=True)
        return out

    # ---- writing -----------------------------------------------------------------------------

    def _write_meta(self, path: Path, manifest: dict[str, Any]) -> None:
        atomic_write_json(path / MANIFEST_FILE, manifest)

    def create(self, name: str, description: str | None = None) -> dict[str, Any]:
        check_judgment_name(name, creating=True)
        if description is not None and not isinstance(description, str):
            raise judgment_invalid("`description` must be a string or null", param="description")
        with self._lock(name):
            dirswap.recover(self.root, name)
            final = self.root / name
            if final.exists():
                raise KilnError(409, "dataset_exists", f"judgment set {name!r} already exists", param="name",
                                hint="Pick another name, or DELETE /v1/judgments/{name} first.")
            staging = dirswap.make_staging(self.root, name)
            try:
                now = utc_now_rfc3339()
                atomic_write_bytes(staging / ROWS_FILE, b"")
                manifest = {"name": name, "description": description or None, "num_rows": 0,
                            "created_at": now, "updated_at": now, "winner_histogram": {}}
                self._write_meta(staging, manifest)
                dirswap.publish_new(staging, final)
            except BaseException:
                dirswap.discard(staging)
                raise
        return manifest

    def append(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Store one judgment; returns {judgment_id, ...manifest} once the row is on disk."""
        check_judgment_name(name)
        row = row_from_body(body, utc_now_rfc3339())
        with self._lock(name):
            path = self._existing(name)
            rows = self._rows(path)
            if any(r.id == row.id for r in rows):
                raise KilnError(409, "judgment_row_exists", f"{name!r} already has a judgment with id {row.id!r}",
                                param="id", hint="Omit `id` to have one assigned.")
            append_jsonl(path / ROWS_FILE, [row.to_json()])
            rows.append(row)
            manifest = self._manifest(name, path, rows)
            self._write_meta(path, manifest)
        return {"judgment_id": row.id, **manifest}

    def delete_row(self, name: str, judgment_id: str) -> dict[str, Any]:
        """Remove one row by rewriting the file atomically; unparseable lines are kept as they are."""
        check_judgment_name(name)
        with self._lock(name):
            path = self._existing(name)
            lines = (path / ROWS_FILE).read_bytes().split(b"\n")
            kept, found = [], False
            for line in lines:
                if not line.strip():
                    continue
                if not found and _line_id(line) == judgment_id:
                    found = True
                    continue
                kept.append(line + b"\n")
            if not found:
                raise KilnError(404, "judgment_not_found", f"judgment {judgment_id!r} not found in {name!r}",
                                param="judgment_id", hint=f"List rows of {name!r} to find the id.")
            atomic_write_bytes(path / ROWS_FILE, b"".join(kept))
            meta = {**_read_json(path / MANIFEST_FILE), "updated_at": utc_now_rfc3339()}
            manifest = self._manifest(name, path, self._rows(path), meta)
            self._write_meta(path, manifest)
        return manifest

    def delete(self, name: str) -> None:
        check_judgment_name(name)
        with self._lock(name):
            dirswap.recover(self.root, name)
            dirswap.remove(self._existing(name))

    def compile(self, name: str, datasets: DatasetStore, output_dataset: str, *, holdout_n: int | None = None,
                include_skips: bool = False) -> dict[str, Any]:
        """Write the swap-augmented SFT dataset `output_dataset`; returns a CompileJudgmentResponse."""
        check_judgment_name(name)
        check_dataset_name(output_dataset, param="output_dataset")
        with self._lock(name):
            path = self._existing(name)
            rows = self._rows(path)
            plan: CompilePlan = plan_compile(name, rows, holdout_n=holdout_n, include_skips=include_skips)
            description = (f"Judge training data compiled from judgments {name!r}: {plan.train_validation_split} "
                           f"source rows, both A/B orders; the last {plan.holdout_n} held out.")
            dataset = datasets.create_rows(output_dataset, plan.sft_rows, description=description)
            now = utc_now_rfc3339()
            meta = {**_read_json(path / MANIFEST_FILE), "last_compiled_split": plan.train_validation_split,
                    "last_compiled_at": now, "updated_at": now}
            self._write_meta(path, self._manifest(name, path, rows, meta))
        return {"status": "compiled", "rows": len(plan.sft_rows), "holdout_n": plan.holdout_n,
                "train_validation_split": plan.train_validation_split, "dataset": dataset,
                "warnings": plan.warnings}


def _line_id(line: bytes) -> str | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value.get("id") if isinstance(value, dict) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
