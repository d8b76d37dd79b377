"""A fanned-out eval's replicas, as resolved when it was admitted, are archived beside the job: the
placement record names them (name, url, kind, cap) after they leave the registry and after a restart,
and the job runs on them even when the registry changed while it waited in the queue."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kiln.evals.jobs import new_job_id
from kiln.replicas.compat import LocalModel
from kiln.replicas.evals import ReplicaFanOut, placement_root
from kiln.replicas.service import ReplicaService
from tests.replicas.http_stand_ins import FakeVllm


@pytest.fixture
def replica():
    fake = FakeVllm(base="tiny")
    yield fake
    fake.close()


def server(tmp_path) -> tuple[ReplicaService, ReplicaFanOut]:
    """The replica service and fan-out one server process holds over `tmp_path` (a new call: a restart)."""
    service = ReplicaService(tmp_path / "replicas", [], lambda: LocalModel("tiny", None))
    fan = ReplicaFanOut(service, placement_root(tmp_path), local_capacity=2, revision=lambda name: "sha256:0",
                        local_model_name=lambda: "tiny")
    return service, fan


def job() -> SimpleNamespace:
    return SimpleNamespace(job_id=new_job_id(), adapters=[""], replicas=None)


def test_the_replica_list_is_readable_after_removal_and_restart(tmp_path, replica):
    service, fan = server(tmp_path)
    service.add({"name": "gpu-a", "url": replica.url, "kind": "vllm", "max_concurrency": 3})
    queued = job()
    queued.replicas = fan.admit(["gpu-a"], queued)
    service.remove("gpu-a")
    expected = [{"name": "gpu-a", "url": replica.url, "kind": "vllm", "max_concurrency": 3}]
    assert fan.placement(queued.job_id)["replica_list"] == expected
    _, after_restart = server(tmp_path)
    record = after_restart.placement(queued.job_id)
    assert record["replicas"] == ["gpu-a"] and record["replica_list"] == expected


def test_a_queued_job_runs_on_the_replicas_it_was_admitted_with(tmp_path, replica):
    service, fan = server(tmp_path)
    service.add({"name": "gpu-a", "url": replica.url, "kind": "vllm"})
    queued = job()
    queued.replicas = fan.admit("all", queued)
    service.remove("gpu-a")  # while the job waits
    generator = fan.generator(queued, local=SimpleNamespace())
    try:
        assert [t.name for t in generator.targets] == ["local", "gpu-a"]
        assert fan.placement(queued.job_id)["replica_list"][0]["url"] == replica.url
    finally:
        asyncio.run(generator.aclose())
