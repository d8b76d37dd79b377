"""The known replicas: `[[replicas]]` from the config (fixed while the process lives) and those added
over the API, kept in <data_dir>/replicas/replicas.json (written atomically, whole)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.config import ConfigError
from kiln.errors import KilnError
from kiln.replicas.spec import ReplicaSpec, parse_replica
from kiln.store.atomic import atomic_write_json

FILE = "replicas.json"


def replica_not_found(name: str) -> KilnError:
    return KilnError(404, "replica_not_found", f"Replica {name!r} is not known.", param="name",
                     hint="GET /v1/replicas lists them; POST /v1/replicas adds one.")


def config_replicas(tables: Iterable[dict[str, Any]]) -> list[ReplicaSpec]:
    out: list[ReplicaSpec] = []
    for i, table in enumerate(tables):
        try:
            spec = parse_replica(table)
        except KilnError as e:
            raise ConfigError(f"replicas[{i}]: {e.message}") from None
        if any(s.name == spec.name for s in out):
            raise ConfigError(f"replicas[{i}]: the name {spec.name!r} is used twice")
        out.append(spec)
    return out


class ReplicaRegistry:
    def __init__(self, root: str | Path, configured: Iterable[dict[str, Any]] = ()) -> None:
        self.root = Path(root)
        self.configured = {s.name: s for s in config_replicas(configured)}
        self._lock = threading.Lock()
        self._added = self._read()

    def _read(self) -> dict[str, ReplicaSpec]:
        path = self.root / FILE
        if not path.exists():
            return {}
        rows = json.loads(path.read_text())
        specs = [parse_replica(row) for row in rows.get("replicas", [])]
        return {s.name: s for s in specs if s.name not in self.configured}

    def _write(self) -> None:
        atomic_write_json(self.root / FILE, {"replicas": [s.to_dict() for s in self._added.values()]})

    def all(self) -> list[ReplicaSpec]:
        with self._lock:
            return [*self.configured.values(), *self._added.values()]

    def source(self, name: str) -> str:
        return "config" if name in self.configured else "api"

    def get(self, name: str) -> ReplicaSpec:
        with self._lock:
            spec = self.configured.get(name) or self._added.get(name)
        if spec is None:
            raise replica_not_found(name)
        return spec

    def select(self, names: Any, *, param: str = "replicas") -> list[ReplicaSpec]:
        """`"all"` or a list of names, each known; a 400 for any other shape."""
        if names == "all":
            return self.all()
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise KilnError(400, "replica_invalid", f"{param} must be \"all\" or a non-empty list of replica names",
                            param=param, hint="GET /v1/replicas lists the known replicas.")
        if len(set(names)) != len(names):
            raise KilnError(400, "replica_invalid", f"{param} names a replica twice", param=param)
        return [self.get(n) for n in names]

    def add(self, spec: ReplicaSpec) -> ReplicaSpec:
        with self._lock:
            if spec.name in self.configured or spec.name in self._added:
                raise KilnError(409, "replica_exists", f"A replica named {spec.name!r} already exists.", param="name",
                                hint="DELETE /v1/replicas/{name} first, or pick another name.")
            self._added[spec.name] = spec
            try:
                self._write()
            except OSError:
                del self._added[spec.name]
                raise
        return spec

    def remove(self, name: str) -> ReplicaSpec:
        with self._lock:
            if name in self.configured:
                raise KilnError(409, "replica_configured", f"Replica {name!r} comes from the config file.",
                                param="name", hint="Remove its [[replicas]] table from the config and restart.")
            spec = self._added.pop(name, None)
            if spec is None:
                raise replica_not_found(name)
            try:
                self._write()
            except OSError:
                self._added[name] = spec
                raise
        return spec
