"""GET/POST/DELETE /v1/replicas over a real app (no model needed): validation, persistence, status."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kiln.config import DataSettings, Settings
from kiln.server import build_server


def _client(tmp_path, replicas=()) -> TestClient:
    settings = Settings(data=DataSettings(data_dir=str(tmp_path / "data")), replicas=list(replicas))
    return TestClient(build_server(settings, routers=["kiln.api.routers.replicas"]).app)


def test_added_replica_is_listed_with_an_unreachable_status_and_persists(tmp_path):
    client = _client(tmp_path, [{"name": "cfg", "url": "http://127.0.0.1:9"}])
    r = client.post("/v1/replicas", json={"name": "r1", "url": "http://127.0.0.1:9", "kind": "vllm",
                                          "max_concurrency": 2})
    assert r.status_code == 200, r.text
    assert r.json()["status"]["state"] == "unreachable" and r.json()["source"] == "api"
    listed = {x["name"]: x for x in client.get("/v1/replicas").json()["data"]}
    assert set(listed) == {"cfg", "r1"} and listed["cfg"]["source"] == "config"
    assert listed["r1"]["max_concurrency"] == 2 and listed["r1"]["published"] == {}
    again = _client(tmp_path, [{"name": "cfg", "url": "http://127.0.0.1:9"}])
    assert [x["name"] for x in again.get("/v1/replicas").json()["data"]] == ["cfg", "r1"]
    assert again.delete("/v1/replicas/r1").json() == {"status": "deleted", "name": "r1"}
    assert again.get("/v1/replicas/r1").status_code == 404


def test_bad_replicas_get_clear_errors(tmp_path):
    client = _client(tmp_path, [{"name": "cfg", "url": "http://127.0.0.1:9"}])
    r = client.post("/v1/replicas", json={"name": "a/b", "url": "http://h"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert client.post("/v1/replicas", content=b"[1]").status_code == 400
    assert client.post("/v1/replicas", json={"name": "cfg", "url": "http://h"}).status_code == 409
    r = client.delete("/v1/replicas/cfg")
    assert r.status_code == 409 and r.json()["error"]["code"] == "replica_configured"
