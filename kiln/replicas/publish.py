"""Publish an adapter to replicas and take it back, recording which revision each one serves.

Every named replica is checked first (reachable, serving our base model, able to take adapters);
one that fails the check refuses the whole request with 409 before anything is sent anywhere. Then
each replica gets its push (kiln.replicas.push), retried with backoff; a replica's record changes only
once its push is verified, so a failure leaves it on its previous record, and the answer lists, per
replica, what happened, how many attempts it took and why it failed.
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
        for spec in specs:
            attempts = Attempts()
            entry: dict[str, Any] = {"replica": spec.name, "kind": spec.kind}
            try:
                with httpx.Client(timeout=PUSH_TIMEOUT_SECS) as client:
                    if spec.kind == "kiln":
                        action = self._retry(lambda c=client, s=spec: push_kiln(c, s, adapter, activate=activate),
                                             attempts)
                    else:
                        action = self._retry(lambda c=client, s=spec: push_vllm(c, s, adapter), attempts)
                record = self.service.records.set(spec.name, adapter.name, adapter.revision)
                entry.update(status="published", action=action, **record)
            except PushError as e:
                entry.update(status="failed", error=str(e), previous=self.service.records.get(spec.name, adapter.name))
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
