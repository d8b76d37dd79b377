"""Which revision of which adapter each replica serves, as published from here.

One JSON file, <data_dir>/replicas/published.json, rewritten atomically after each replica's push
or removal completes: a record exists only for a push that finished and was verified.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from kiln.store.atomic import atomic_write_json
from kiln.store.clock import utc_now_rfc3339

FILE = "published.json"


class PublishRecords:
    def __init__(self, root: Path) -> None:
        self.path = root / FILE
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, dict[str, Any]]] = (
            json.loads(self.path.read_text()).get("replicas", {}) if self.path.exists() else {})

    def for_replica(self, replica: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._data.get(replica, {}).items()}

    def for_adapter(self, adapter: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {r: dict(a[adapter]) for r, a in self._data.items() if adapter in a}

    def get(self, replica: str, adapter: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._data.get(replica, {}).get(adapter)
            return dict(rec) if rec else None

    def set(self, replica: str, adapter: str, revision: str, **extra: Any) -> dict[str, Any]:
        rec = {"revision": revision, "published_at": utc_now_rfc3339(), **extra}
        with self._lock:
            self._data.setdefault(replica, {})[adapter] = rec
            self._write()
        return dict(rec)

    def drop(self, replica: str, adapter: str) -> None:
        with self._lock:
            if self._data.get(replica, {}).pop(adapter, None) is not None:
                if not self._data[replica]:
                    del self._data[replica]
                self._write()

    def _write(self) -> None:
        atomic_write_json(self.path, {"replicas": self._data})
