"""Eval fan-out over replicas: which replicas a run may use, the generator that deals to them, and
where the placement is kept (<data_dir>/eval/placement/<job id>.json, beside the job archives).

The placement record is written when a run is admitted, before it is queued: the replicas it names as
resolved then (`replica_list`: name, url, kind, max_concurrency), which the run then uses, so the
record says where the examples went after those replicas leave the registry or the server restarts.

A run may name a replica that is reachable and serves our base model; for a run on an adapter, each
replica must serve the revision this server holds (publish it first). The local engine always takes
part, listed first; each replica is reached through kiln.evals.remote_generator with its own cap.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.evals.fanout import FanOutGenerator, Target
from kiln.evals.generator import Generator
from kiln.evals.jobs import EvalJob
from kiln.evals.remote_generator import RemoteGenerator
from kiln.replicas.service import ReplicaService
from kiln.replicas.spec import ReplicaSpec
from kiln.store.atomic import atomic_write_json
from kiln.store.names import name_problem

LOCAL = "local"
REMOTE_TIMEOUT_SECS = 300.0
MAX_PENDING = 1024  # admitted jobs whose resolved replicas are held until they start


def placement_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "eval" / "placement"


def _archived(spec: ReplicaSpec) -> dict[str, Any]:
    """A replica as a job's record keeps it: what it was called, where it was and what it was."""
    return {"name": spec.name, "url": spec.url, "kind": spec.kind, "max_concurrency": spec.max_concurrency,
            **({"base_model": spec.base_model} if spec.base_model else {})}


def _refused(name: str, why: str, hint: str) -> KilnError:
    return KilnError(409, "replica_not_ready", f"Replica {name!r} cannot take this eval: {why}", param="replicas",
                     hint=hint)


class ReplicaFanOut:
    def __init__(self, service: ReplicaService, root: Path, *, local_capacity: int,
                 revision: Callable[[str], str], local_model_name: Callable[[], str | None]) -> None:
        self.service = service
        self.root = root
        self.local_capacity = local_capacity
        self.revision = revision                  # an adapter's content digest here
        self.local_model_name = local_model_name
        self._lock = threading.Lock()
        self._resolved: dict[str, list[ReplicaSpec]] = {}  # admitted jobs not started yet

    def admit(self, replicas: Any, job: EvalJob) -> list[str]:
        specs = self.service.registry.select(replicas)
        for spec in specs:
            status = self.service.health.check(spec)
            if status.state != "ok":
                raise _refused(spec.name, f"it is {status.state}" + (f" ({status.error})" if status.error else ""),
                               "GET /v1/replicas shows each replica's status.")
            if not status.compatible:
                raise _refused(spec.name, f"it does not serve our base model: {status.compatibility_problem}",
                               "Leave it out, or point it at the same base model.")
            for adapter in job.adapters:
                if not adapter:
                    continue
                record = self.service.records.get(spec.name, adapter)
                if record is None or record["revision"] != self.revision(adapter):
                    raise _refused(spec.name, f"it does not serve adapter {adapter!r} as stored here",
                                   f"POST /v1/adapters/{adapter}/publish with {{\"replicas\": [\"{spec.name}\"]}} first.")
        # the replicas as resolved now are the job's: archived beside it before it is queued, and the
        # ones its generator uses, whatever becomes of the registry meanwhile
        with self._lock:
            self._resolved[job.job_id] = specs
            while len(self._resolved) > MAX_PENDING:  # admitted, then refused a place in the queue
                del self._resolved[next(iter(self._resolved))]
        self._write_body(job.job_id, {"job_id": job.job_id, "replicas": [s.name for s in specs],
                                      "replica_list": [_archived(s) for s in specs], "examples": []})
        return [s.name for s in specs]

    def generator(self, job: EvalJob, local: Generator) -> Generator:
        targets = [Target(LOCAL, local, self.local_capacity)]
        with self._lock:
            specs = self._resolved.pop(job.job_id, None)
        if specs is None:  # admitted by another process: the registry as it is now
            specs = [self.service.registry.get(name) for name in job.replicas or []]
        for spec in specs:
            remote = RemoteGenerator(spec.api_root, model=spec.base_model or self.local_model_name(),
                                     api_key=spec.api_key(), concurrency=spec.max_concurrency,
                                     timeout=REMOTE_TIMEOUT_SECS)
            targets.append(Target(spec.name, remote, spec.max_concurrency))
        archived = [_archived(s) for s in specs]
        fan = FanOutGenerator(targets, on_placed=lambda g: self._write(job, g, archived))
        self._write(job, fan, archived)
        return fan

    def _path(self, job_id: str) -> Path:
        if name_problem(job_id) is not None:
            raise KilnError(400, "eval_invalid_request", "Invalid eval request: bad job id", param="job_id")
        return self.root / f"{job_id}.json"

    def _write(self, job: EvalJob, fan: FanOutGenerator, archived: list[dict[str, Any]]) -> None:
        self._write_body(job.job_id, {"job_id": job.job_id, "replicas": job.replicas, "replica_list": archived,
                                      **fan.summary(), "examples": [p.to_dict() for p in fan.placement]})

    def _write_body(self, job_id: str, body: dict[str, Any]) -> None:
        with self._lock:
            atomic_write_json(self._path(job_id), body, indent=None)

    def placement(self, job_id: str) -> dict[str, Any] | None:
        path = self._path(job_id)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
