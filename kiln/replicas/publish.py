"""Publish an adapter to replicas and take it back, recording which revision each one serves.

Every named replica is checked first (reachable, serving our base model, able to take adapters);
one that fails the check refuses the whole request with 409 before anything is sent anywhere. Then
each replica gets its push (kiln.replicas.push), retried with backoff; a replica's record changes only
once its push is verified. A push that fails leaves the replica serving its previous revision (the
pushes never take the old one away first) and its record as it was; the failure is recorded beside it
(kiln.replicas.records), and the answer lists, per replica, what happened, how many attempts it took,
why it failed and which revision the replica serves now (`serving`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from kiln.errors import KilnError
from kiln.replicas.push import (
    Adapter,
    Attempts,
    PushError,
    push_kiln,
    push_vllm,
    serving_kiln,
    serving_vllm,
    unpush_kiln,
    unpush_vllm,
    with_retries,
)
from kiln.replicas.service import ReplicaService
from kiln.replicas.spec import ReplicaSpec

PUSH_TIMEOUT_SECS = 120.0


def _refused(problems: dict[str, str]) -> KilnError:
    listed = "; ".join(f"{name}: {why}" for name, why in problems.items())
    return KilnError(409, "replica_not_ready", f"Not published anywhere: {listed}", param="replicas",
                     hint="GET /v1/replicas shows each replica's status; fix or leave out the ones named.")


def _serving(client: httpx.Client, spec: ReplicaSpec, name: str, previous: dict[str, Any] | None) -> str | None:
    """After a failed push: the revision the replica serves now, as far as it says (a Kiln replica lists
    digests; a vLLM one only names, so a listed name is taken to be the recorded revision). None: it
    serves none, or cannot be asked."""
    try:
        if spec.kind == "kiln":
            return serving_kiln(client, spec, name)
        return (previous or {}).get("revision") if serving_vllm(client, spec, name) else None
    except (PushError, httpx.HTTPError):
        return None


class Publisher:
    def __init__(self, service: ReplicaService, *, tries: int = 3, backoff: float = 0.5,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.service = service
        self.tries, self.backoff = tries, backoff
        self._sleep = sleep

    def _retry(self, fn, attempts: Attempts):
        kwargs = {"sleep": self._sleep} if self._sleep is not None else {}
        return with_retries(fn, attempts, tries=self.tries, backoff=self.backoff, **kwargs)

    def preflight(self, specs: list[ReplicaSpec]) -> None:
        problems: dict[str, str] = {}
        for spec in specs:
            if spec.kind == "openai":
                problems[spec.name] = "an OpenAI-compatible replica has no API to load adapters"
                continue
            if spec.kind == "vllm" and spec.lora_dir is None:
                problems[spec.name] = "a vLLM replica needs lora_dir (a folder both servers reach)"
                continue
            status = self.service.health.check(spec)
            if status.state != "ok":
                problems[spec.name] = f"{status.state}" + (f" ({status.error})" if status.error else "")
            elif not status.compatible:
                problems[spec.name] = f"does not serve our base model: {status.compatibility_problem}"
        if problems:
            raise _refused(problems)

    def publish(self, adapter: Adapter, replicas: Any, *, activate: bool = False) -> dict[str, Any]:
        specs = self.service.registry.select(replicas)
        self.preflight(specs)
        results = {}
        records = self.service.records
        for spec in specs:
            attempts = Attempts()
            entry: dict[str, Any] = {"replica": spec.name, "kind": spec.kind}
            previous = records.get(spec.name, adapter.name)
            with httpx.Client(timeout=PUSH_TIMEOUT_SECS) as client:
                try:
                    if spec.kind == "kiln":
                        action = self._retry(lambda c=client, s=spec: push_kiln(c, s, adapter, activate=activate),
                                             attempts)
                    else:
                        before = previous["revision"] if previous else None
                        action = self._retry(lambda c=client, s=spec, b=before: push_vllm(c, s, adapter, previous=b),
                                             attempts)
                    entry.update(status="published", action=action,
                                 **records.set(spec.name, adapter.name, adapter.revision))
                except PushError as e:
                    records.fail(spec.name, adapter.name, adapter.revision, str(e), attempts.count)
                    entry.update(status="failed", error=str(e), previous=previous,
                                 serving=_serving(client, spec, adapter.name, previous))
            entry["attempts"] = attempts.count
            if attempts.errors and entry["status"] == "published":
                entry["retried_errors"] = attempts.errors
            results[spec.name] = entry
        failed = [n for n, e in results.items() if e["status"] == "failed"]
        return {"adapter": adapter.name, "revision": adapter.revision,
                "status": "failed" if failed else "published", "failed": failed, "replicas": results}

    def unpublish(self, name: str, replicas: Any) -> dict[str, Any]:
        specs = self.service.registry.select(replicas)
        results = {}
        for spec in specs:
            attempts = Attempts()
            entry: dict[str, Any] = {"replica": spec.name}
            try:
                with httpx.Client(timeout=PUSH_TIMEOUT_SECS) as client:
                    if spec.kind == "kiln":
                        self._retry(lambda c=client, s=spec: unpush_kiln(c, s, name), attempts)
                    elif spec.kind == "vllm":
                        self._retry(lambda c=client, s=spec: unpush_vllm(c, s, name), attempts)
                self.service.records.drop(spec.name, name)
                entry["status"] = "unpublished"
            except PushError as e:
                entry.update(status="failed", error=str(e))
            entry["attempts"] = attempts.count
            results[spec.name] = entry
        failed = [n for n, e in results.items() if e["status"] == "failed"]
        return {"adapter": name, "status": "failed" if failed else "unpublished", "failed": failed,
                "replicas": results}
