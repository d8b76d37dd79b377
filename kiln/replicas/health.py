"""What each replica serves, checked now (`probe`) or every few seconds (`HealthPoller`, a daemon thread).

Only the replicas' own URLs are contacted, each call with a short timeout: a Kiln replica answers
/health, /v1/models and /v1/config (its served model id and base weights' digest); a vLLM replica
/health and /v1/models; an OpenAI-compatible one /v1/models. The status a probe leaves is what
GET /v1/replicas shows and what publishing and eval fan-out consult.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kiln.replicas.compat import LocalModel, RemoteModel, base_model_problem
from kiln.replicas.spec import ReplicaSpec
from kiln.store.clock import utc_now_rfc3339

log = logging.getLogger("kiln.replicas")

POLL_INTERVAL_SECS = 10.0
PROBE_TIMEOUT_SECS = 5.0


@dataclass
class ReplicaStatus:
    state: str = "unknown"            # unknown | ok | unhealthy | unreachable
    checked_at: str | None = None
    latency_ms: float | None = None
    error: str | None = None
    served_models: list[str] = field(default_factory=list)
    base_models: list[str] = field(default_factory=list)
    base_model_sha256: str | None = None
    compatible: bool | None = None    # serves our base model (None: not known yet)
    compatibility_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _models(body: Any) -> tuple[list[str], list[str]]:
    """(every id, the ids that are not adapters) of a /v1/models answer."""
    data = body.get("data") if isinstance(body, dict) else None
    ids, bases = [], []
    for m in data if isinstance(data, list) else []:
        if isinstance(m, dict) and isinstance(m.get("id"), str):
            ids.append(m["id"])
            # vLLM and Kiln mark an adapter with `parent` (its base model)
            if not m.get("parent"):
                bases.append(m["id"])
    return ids, bases


def probe(spec: ReplicaSpec, local: LocalModel, client: httpx.Client) -> ReplicaStatus:
    """One look at the replica; never raises for what the replica does."""
    status = ReplicaStatus(checked_at=utc_now_rfc3339())
    started = time.perf_counter()
    headers = spec.headers()
    try:
        if spec.kind in ("kiln", "vllm"):
            health = client.get(spec.url + "/health", headers=headers)
            if health.status_code != 200:
                status.state, status.error = "unhealthy", f"/health answered HTTP {health.status_code}"
        models = client.get(spec.api_root + "/models", headers=headers)
        if models.status_code != 200:
            status.state, status.error = "unhealthy", f"/v1/models answered HTTP {models.status_code}"
            return status
        status.served_models, status.base_models = _models(models.json())
        if spec.kind == "kiln":
            config = client.get(spec.api_root + "/config", headers=headers)
            model = config.json().get("model") if config.status_code == 200 else None
            if isinstance(model, dict):
                status.base_model_sha256 = model.get("base_model_sha256")
                if isinstance(model.get("served_model_id"), str):
                    status.base_models = [model["served_model_id"]]
    except (httpx.HTTPError, ValueError) as e:
        status.state, status.error = "unreachable", f"{type(e).__name__}: {e}"
        return status
    finally:
        status.latency_ms = round((time.perf_counter() - started) * 1000, 1)
    if status.state == "unknown":
        status.state = "ok"
    problem = base_model_problem(spec.kind, local, RemoteModel(tuple(status.base_models), status.base_model_sha256),
                                 spec.base_model)
    status.compatible, status.compatibility_problem = problem is None, problem
    return status


class HealthPoller:
    """Keeps the latest status of every replica the registry lists, refreshed every `interval` seconds."""

    def __init__(self, replicas: Callable[[], list[ReplicaSpec]], local: Callable[[], LocalModel], *,
                 interval: float = POLL_INTERVAL_SECS, timeout: float = PROBE_TIMEOUT_SECS) -> None:
        self.replicas, self.local = replicas, local
        self.interval, self.timeout = interval, timeout
        self._status: dict[str, ReplicaStatus] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self, name: str) -> ReplicaStatus:
        with self._lock:
            return self._status.get(name) or ReplicaStatus()

    def check(self, spec: ReplicaSpec) -> ReplicaStatus:
        """Probe one replica now and remember the answer."""
        with httpx.Client(timeout=self.timeout) as client:
            status = probe(spec, self.local(), client)
        with self._lock:
            self._status[spec.name] = status
        return status

    def forget(self, name: str) -> None:
        with self._lock:
            self._status.pop(name, None)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kiln-replica-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> None:
        for spec in self.replicas():
            if self._stop.is_set():
                return
            before = self.status(spec.name).state
            status = self.check(spec)
            if status.state != before:
                log.info("replica %s: %s%s", spec.name, status.state, f" ({status.error})" if status.error else "")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the poller outlives any one bad answer
                log.exception("replica health poll failed")
            self._stop.wait(self.interval)
