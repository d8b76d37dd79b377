"""A directory of JSON records, one file per id, written atomically (eval and training job archives)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.store.atomic import atomic_write_json, fsync_path
from kiln.store.sweep import sweep_temp_files


class JsonRecordDir:
    def __init__(self, root: str | Path, not_found: Callable[[str], KilnError]) -> None:
        self.root = Path(root)
        self._not_found = not_found

    def path_for(self, record_id: str) -> Path:
        # Ids are generated, but a route names one: never leave the directory.
        if not record_id or "/" in record_id or "\\" in record_id or record_id.startswith("."):
            raise self._not_found(record_id)
        return self.root / f"{record_id}.json"

    def write(self, record_id: str, data: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path_for(record_id), data)

    def sweep(self) -> list[str]:
        """Startup sweep: temp files of record writes a kill interrupted."""
        return sweep_temp_files(self.root)

    def delete(self, record_id: str) -> bool:
        try:
            os.unlink(self.path_for(record_id))
        except FileNotFoundError:
            return False
        fsync_path(self.root)
        return True
