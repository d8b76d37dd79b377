"""Which revision of which adapter each replica serves, as published from here, and which pushes failed.

One JSON file, <data_dir>/replicas/published.json, rewritten atomically after each replica's push
or removal completes: `replicas` holds a record only for a push that finished and was verified (what
the replica serves); `failures` holds the last failed push of an adapter to a replica (the revision it
tried, why it failed, when), which the next verified push or an unpublish clears. A failed push never
touches the `replicas` record: the replica still serves that revision.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from kiln.store.atomic import atomic_write_json
from kiln.store.clock import utc_now_rfc3339

FILE = "published.json"

Table = dict[str, dict[str, dict[str, Any]]]


class PublishRecords:
    def __init__(self, root: Path) -> None:
        self.path = root / FILE
        self._lock = threading.Lock()
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self._data: Table = data.get("replicas", {})
        self._failures: Table = data.get("failures", {})

    def for_replica(self, replica: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._data.get(replica, {}).items()}

    def failures_for_replica(self, replica: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._failures.get(replica, {}).items()}

    def for_adapter(self, adapter: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {r: dict(a[adapter]) for r, a in self._data.items() if adapter in a}

    def failures_for_adapter(self, adapter: str) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {r: dict(a[adapter]) for r, a in self._failures.items() if adapter in a}

    def get(self, replica: str, adapter: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._data.get(replica, {}).get(adapter)
            return dict(rec) if rec else None

    def set(self, replica: str, adapter: str, revision: str, **extra: Any) -> dict[str, Any]:
        rec = {"revision": revision, "published_at": utc_now_rfc3339(), **extra}
        with self._lock:
            self._data.setdefault(replica, {})[adapter] = rec
            _pop(self._failures, replica, adapter)
            self._write()
        return dict(rec)

    def fail(self, replica: str, adapter: str, revision: str, error: str, attempts: int) -> dict[str, Any]:
        rec = {"revision": revision, "error": error, "attempts": attempts, "failed_at": utc_now_rfc3339()}
        with self._lock:
            self._failures.setdefault(replica, {})[adapter] = rec
            self._write()
        return dict(rec)

    def drop(self, replica: str, adapter: str) -> None:
        with self._lock:
            if _pop(self._data, replica, adapter) | _pop(self._failures, replica, adapter):
                self._write()

    def forget(self, replica: str) -> None:
        """A removed replica's failed pushes go with it (it has no published record: see the service)."""
        with self._lock:
            if self._failures.pop(replica, None) is not None:
                self._write()

    def _write(self) -> None:
        atomic_write_json(self.path, {"replicas": self._data, "failures": self._failures})


def _pop(table: Table, replica: str, adapter: str) -> bool:
    if table.get(replica, {}).pop(adapter, None) is None:
        return False
    if not table[replica]:
        del table[replica]
    return True
