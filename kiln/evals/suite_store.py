"""Registered suites under `<data_dir>/eval/suites/<name>/suite.json`, written atomically."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any, Literal

from kiln.errors import KilnError
from kiln.evals.suite import EvalSuite, parse_suite, suite_summary
from kiln.store.atomic import atomic_write_json, fsync_path
from kiln.store.names import validate_name
from kiln.store.sweep import is_atomic_temp, remove_path, sweep_temp_files

log = logging.getLogger("kiln.evals")

SUITE_FILE = "suite.json"


def suite_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "eval" / "suites"


class SuiteStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        # Check-then-write (409 without force) must not race another save of the same name.
        self._lock = threading.Lock()

    def _dir(self, name: str) -> Path:
        validate_name(name, kind="suite", param="name", code="invalid_suite_name")
        return self.root / name

    def path_for(self, name: str) -> Path:
        return self._dir(name) / SUITE_FILE

    def exists(self, name: str) -> bool:
        return self.path_for(name).is_file()

    def save(self, suite: EvalSuite, *, force: bool = False) -> tuple[Path, Literal["created", "overwritten"]]:
        path = self.path_for(suite.name)
        with self._lock:
            existed = path.is_file()
            if existed and not force:
                raise KilnError(
                    409, "eval_suite_exists", f"Eval suite {suite.name!r} already exists",
                    param="name", hint="Pass ?force=true to overwrite it, or choose another name.",
                )
            atomic_write_json(path, suite.to_json())
        return path, "overwritten" if existed else "created"

    def get_json(self, name: str) -> dict[str, Any]:
        path = self.path_for(name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise KilnError(404, "eval_suite_not_found", f"Eval suite {name!r} not found", param="name",
                            hint="List registered suites with GET /v1/eval/suites.") from None
        except (OSError, ValueError) as e:
            raise KilnError(500, "internal_error", f"stored eval suite {name!r} is unreadable: {e}") from None

    def get(self, name: str) -> EvalSuite:
        data = self.get_json(name)
        try:
            return parse_suite(data)
        except KilnError as e:
            raise KilnError(500, "internal_error", f"stored eval suite {name!r} is no longer valid: {e.message}") from None

    def delete(self, name: str) -> None:
        target = self._dir(name)
        with self._lock:
            if not (target / SUITE_FILE).is_file():
                raise KilnError(404, "eval_suite_not_found", f"Eval suite {name!r} not found", param="name",
                                hint="List registered suites with GET /v1/eval/suites.")
            # Rename first so a crash mid-delete never leaves a half-deleted suite visible.
            tomb = self.root / f".deleting-{name}-{secrets.token_hex(4)}"
            os.replace(target, tomb)
            fsync_path(self.root)
        shutil.rmtree(tomb, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Startup sweep: half-deleted tombs, temp files, and folders a kill left without a suite.json
        (`save` makes the folder, then writes the file) that hold nothing but temp files."""
        done: list[str] = []
        if not self.root.is_dir():
            return done
        with self._lock:
            done += sweep_temp_files(self.root)
            for entry in sorted(os.listdir(self.root)):
                path = self.root / entry
                if entry.startswith(".deleting-"):
                    remove_path(path)
                    done.append(f"removed {path}")
                elif not entry.startswith(".") and path.is_dir():
                    done += sweep_temp_files(path)
                    if not (path / SUITE_FILE).exists() and all(is_atomic_temp(e) for e in os.listdir(path)):
                        remove_path(path)
                        done.append(f"removed {path} (no {SUITE_FILE})")
        return done

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if not p.name.startswith(".") and (p / SUITE_FILE).is_file())

    def list_summaries(self) -> list[dict[str, Any]]:
        out = []
        for name in self.names():
            try:
                out.append(suite_summary(self.get(name)))
            except KilnError as e:
                log.warning("skipping unreadable eval suite %s: %s", name, e.message)
        return out
