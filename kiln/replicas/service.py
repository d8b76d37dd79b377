"""The replica service one server holds: the registry, its health poller, and what was published where."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.replicas.compat import LocalModel
from kiln.replicas.health import HealthPoller, ReplicaStatus
from kiln.replicas.records import PublishRecords
from kiln.replicas.registry import ReplicaRegistry
from kiln.replicas.spec import ReplicaSpec, parse_replica


def replica_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "replicas"


class ReplicaService:
    def __init__(self, root: str | Path, configured: list[dict[str, Any]], local: Callable[[], LocalModel], *,
                 poll_interval: float | None = None) -> None:
        self.registry = ReplicaRegistry(root, configured)
        kwargs = {"interval": poll_interval} if poll_interval is not None else {}
        self.health = HealthPoller(self.registry.all, local, **kwargs)
        self.records = PublishRecords(Path(root))
        self.local = local

    def view(self, spec: ReplicaSpec) -> dict[str, Any]:
        return {**spec.to_dict(), "source": self.registry.source(spec.name),
                "status": self.health.status(spec.name).to_dict(),
                "published": self.records.for_replica(spec.name),
                "failed_pushes": self.records.failures_for_replica(spec.name)}

    def list_view(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.view(s) for s in self.registry.all()]}

    def add(self, body: Any) -> dict[str, Any]:
        spec = self.registry.add(parse_replica(body))
        self.health.check(spec)  # its first status at once, not at the next poll
        return self.view(spec)

    def remove(self, name: str) -> dict[str, Any]:
        spec = self.registry.get(name)
        if self.records.for_replica(name):
            raise KilnError(409, "replica_has_adapters", f"Replica {name!r} still serves adapters published from here.",
                            param="name", hint="POST /v1/adapters/{adapter}/unpublish first.")
        self.registry.remove(spec.name)
        self.health.forget(spec.name)
        self.records.forget(spec.name)
        return {"status": "deleted", "name": name}

    def check(self, name: str) -> ReplicaStatus:
        return self.health.check(self.registry.get(name))
