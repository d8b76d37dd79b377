"""Publishing a new revision to a vLLM replica (a stand-in speaking vLLM's LoRA routes on loopback):
the new revision is proven under a staging name before the old one is unloaded, and a failed swap
loads the old one back, so a failed re-publish leaves the replica answering with its previous revision."""

from __future__ import annotations

import httpx
import pytest

from kiln.adapters.store import AdapterStore
from kiln.replicas.compat import LocalModel
from kiln.replicas.publish import Publisher
from kiln.replicas.push import Adapter, vllm_leaf
from kiln.replicas.service import ReplicaService
from tests.adapters.helpers import save_random
from tests.replicas.http_stand_ins import FakeVllm

NAME = "style"


@pytest.fixture
def vllm():
    fake = FakeVllm(base="tiny")
    yield fake
    fake.close()


@pytest.fixture
def fleet(tmp_path, vllm):
    shared = tmp_path / "shared"
    shared.mkdir()
    service = ReplicaService(tmp_path / "replicas", [{"name": "v", "url": vllm.url, "kind": "vllm",
                                                      "lora_dir": str(shared)}],
                             lambda: LocalModel("tiny", None))
    return service, AdapterStore(tmp_path / "adapters"), shared


def revision(store: AdapterStore, seed: int) -> Adapter:
    if store.exists(NAME):
        store.delete(NAME)
    save_random(store, NAME, modules=["q_proj", "v_proj"], seed=seed)
    return Adapter(NAME, store.path(NAME), store.content_hash(NAME), lambda: b"", "tiny")


def answer(vllm: FakeVllm) -> str:
    r = httpx.post(vllm.url + "/v1/chat/completions", json={"model": NAME, "messages": []})
    return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}"


def publisher(service) -> Publisher:
    return Publisher(service, backoff=0.0, sleep=lambda _: None)


def test_a_new_revision_replaces_the_old_through_a_staging_name(fleet, vllm):
    service, store, _ = fleet
    one, two = revision(store, 1), None
    assert publisher(service).publish(one, "all")["replicas"]["v"]["action"] == "loaded"
    two = revision(store, 2)
    result = publisher(service).publish(two, "all")
    assert result["status"] == "published" and result["replicas"]["v"]["action"] == "replaced"
    assert answer(vllm) == vllm_leaf(NAME, two.revision)
    staged = [b["lora_name"] for p, b in vllm.calls if p == "/v1/load_lora_adapter"]
    assert staged[1].startswith(NAME + "--staging-") and staged[2] == NAME
    assert set(vllm.loras) == {NAME}  # the staging name is gone again
    assert service.records.get("v", NAME)["revision"] == two.revision


def test_a_revision_the_replica_refuses_never_unloads_the_old_one(fleet, vllm):
    service, store, _ = fleet
    one = revision(store, 1)
    publisher(service).publish(one, "all")
    two = revision(store, 2)
    vllm.refuse = lambda name, path: 400 if path.endswith(vllm_leaf(NAME, two.revision)) else None
    result = publisher(service).publish(two, "all")
    entry = result["replicas"]["v"]
    assert result["status"] == "failed" and entry["status"] == "failed" and entry["attempts"] == 1
    assert entry["previous"]["revision"] == one.revision and entry["serving"] == one.revision
    assert answer(vllm) == vllm_leaf(NAME, one.revision)
    assert not any(p == "/v1/unload_lora_adapter" and b["lora_name"] == NAME for p, b in vllm.calls)
    # the record still says what the replica serves, and beside it that the push failed
    assert service.records.get("v", NAME)["revision"] == one.revision
    failed = service.records.failures_for_replica("v")[NAME]
    assert failed["revision"] == two.revision and "cannot load" in failed["error"]
    assert service.view(service.registry.get("v"))["failed_pushes"][NAME]["revision"] == two.revision


def test_a_swap_that_fails_after_its_retries_loads_the_old_revision_back(fleet, vllm):
    service, store, _ = fleet
    one = revision(store, 1)
    publisher(service).publish(one, "all")
    two = revision(store, 2)
    new_leaf = vllm_leaf(NAME, two.revision)
    # the staging name loads; the name itself does not take the new folder (a replica gone bad mid-swap)
    vllm.refuse = lambda name, path: 503 if name == NAME and path.endswith(new_leaf) else None
    result = publisher(service).publish(two, "all")
    entry = result["replicas"]["v"]
    assert entry["status"] == "failed" and entry["attempts"] == 3, entry
    assert "loaded back" in entry["error"] and entry["serving"] == one.revision
    assert answer(vllm) == vllm_leaf(NAME, one.revision)
    # once the replica takes it, the next publish replaces it and clears the failure
    vllm.refuse = lambda name, path: None
    again = publisher(service).publish(two, "all")
    assert again["status"] == "published" and answer(vllm) == new_leaf
    assert service.records.failures_for_replica("v") == {}


def test_unpublish_clears_a_failed_push_record(fleet, vllm):
    service, store, _ = fleet
    one = revision(store, 1)
    vllm.refuse = lambda name, path: 400
    assert publisher(service).publish(one, "all")["replicas"]["v"]["serving"] is None
    assert service.records.get("v", NAME) is None and NAME in service.records.failures_for_replica("v")
    assert publisher(service).unpublish(NAME, "all")["status"] == "unpublished"
    assert service.records.failures_for_replica("v") == {}
