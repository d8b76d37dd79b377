"""Adapter routes over HTTP: shapes, error envelopes, and name validation on every route."""

from __future__ import annotations

import io
import os
import tarfile
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

import kiln.api.app as app_module
from kiln.adapters.archive import ArchiveLimits
from kiln.adapters.store import AdapterStore
from kiln.config import DataSettings, Settings
from kiln.server import build_state
from kiln.testing.stand_in import StandInEngine
from tests.adapters.helpers import TINY, save_random

ERROR_KEYS = {"message", "type", "param", "code", "hint"}


@pytest.fixture
def state(tmp_path):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path)))
    return build_state(settings, adapter_store=AdapterStore(settings.adapter_dir,
                                                            limits=ArchiveLimits(max_body_bytes=64_000)))


@pytest.fixture
def store(state):
    s = state.services.adapter_store
    save_random(s, "a", r=4, alpha=8, modules=["q_proj", "v_proj"], seed=1)
    save_random(s, "b", r=4, alpha=8, modules=["q_proj", "v_proj"], seed=2)
    return s


@pytest.fixture
def client(state, monkeypatch):
    # Only this router: the test must not depend on other routers being importable.
    return TestClient(app_module.create_app(state.settings, state, routers=["kiln.api.routers.adapters"]))


def assert_error(resp, status, code):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == code, body
    assert body["error"]["message"] and body["error"]["hint"]
    return body["error"]


def tgz(files: dict[str, bytes], extra=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info)
    return buf.getvalue()


def adapter_files(store, name="a") -> dict[str, bytes]:
    return {f: (store.root / name / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}


def upload(client, name, blob):
    return client.post("/v1/adapters/upload", data={"name": name},
                       files={"archive": ("x.tar.gz", blob, "application/gzip")})


def test_router_is_registered():
    assert "kiln.api.routers.adapters" in app_module.ROUTER_MODULES


def test_list_is_empty_without_adapters(client):
    assert client.get("/v1/adapters").json() == {"active": None, "available": []}


def test_list_shows_each_adapter(client, store):
    body = client.get("/v1/adapters").json()
    assert [a["name"] for a in body["available"]] == ["a", "b"]
    entry = body["available"][0]
    assert {"name", "has_config", "has_weights", "size_bytes", "modified_at", "files", "content_sha256",
            "manifest"} <= set(entry)
    assert entry["content_sha256"] == store.content_hash("a")


def test_detail_describes_rank_modules_and_files(client, store):
    body = client.get("/v1/adapters/a/detail").json()
    assert body["name"] == "a" and body["rank"] == 4 and body["lora_alpha"] == 8
    assert body["modules"] == {"q_proj": [0, 1], "v_proj": [0, 1]}
    assert body["active"] is False and "adapter_model.safetensors" in body["files"]


def test_detail_checks_compatibility_when_a_model_is_served(client, state, store):
    state.engine = StandInEngine(info=SimpleNamespace(config=TINY))
    assert client.get("/v1/adapters/a/detail").json()["compatibility"]["compatible"] is True


def test_upload_then_download_round_trips(client, store):
    resp = upload(client, "up", tgz(adapter_files(store)))
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "uploaded" and resp.json()["name"] == "up"
    dl = client.get("/v1/adapters/up/download")
    assert dl.status_code == 200 and dl.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(dl.content), mode="r:gz") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    for f, data in adapter_files(store).items():
        assert got[f"up/{f}"] == data
    assert upload(client, "again", dl.content).json()["content_sha256"] == store.content_hash("a")


def test_upload_rejects_a_symlink_and_leaves_nothing(client, store):
    link = tarfile.TarInfo("evil")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    before = sorted(os.listdir(store.root))
    assert_error(upload(client, "up", tgz(adapter_files(store), [link])), 400, "adapter_import_invalid")
    assert sorted(os.listdir(store.root)) == before


def test_upload_rejects_path_traversal(client, store):
    files = adapter_files(store) | {"../../escape.txt": b"x"}
    assert_error(upload(client, "up", tgz(files)), 400, "adapter_import_invalid")
    assert not (store.root.parent / "escape.txt").exists()


def test_upload_rejects_an_oversize_body(client, store):
    big = tgz(adapter_files(store) | {"noise.bin": os.urandom(70_000)})
    assert_error(upload(client, "up", big), 400, "adapter_import_invalid")
    assert "up" not in store.names()


def test_upload_body_is_bounded_without_content_length(client, store):
    head = (b"--B\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nup\r\n--B\r\n"
            b"Content-Disposition: form-data; name=\"archive\"; filename=\"x\"\r\n\r\n")

    def chunks():
        yield head
        for _ in range(40):
            yield b"\0" * 8192

    resp = client.post("/v1/adapters/upload", content=chunks(),
                       headers={"content-type": "multipart/form-data; boundary=B"})
    assert "request body exceeds" in assert_error(resp, 400, "adapter_import_invalid")["message"]
    assert "up" not in store.names()


def test_receipt_route(client, store):
    from kiln.adapters.peft_format import config_dict
    from tests.adapters.helpers import random_factors

    store.save_adapter("t", random_factors(2), config_dict(2, 4), receipt={"status": "succeeded", "steps": 3})
    assert client.get("/v1/adapters/t/receipt").json() == {"status": "succeeded", "steps": 3}
    assert_error(client.get("/v1/adapters/a/receipt"), 404, "adapter_not_found")


def test_upload_needs_name_and_archive(client, store):
    assert_error(client.post("/v1/adapters/upload", files={"archive": ("x", b"x")}), 400, "invalid_adapter_name")
    assert_error(client.post("/v1/adapters/upload", data={"name": "x"}, files={"other": ("x", b"x")}), 400,
                 "adapter_import_invalid")
    assert_error(client.post("/v1/adapters/upload", json={"name": "x"}), 400, "adapter_import_invalid")


def test_upload_over_an_existing_name_is_409(client, store):
    assert_error(upload(client, "a", tgz(adapter_files(store))), 409, "adapter_already_exists")


def replace(client, name, blob, flag="true"):
    return client.post("/v1/adapters/upload", data={"name": name, "replace": flag},
                       files={"archive": ("x.tar.gz", blob, "application/gzip")})


def test_upload_with_replace_swaps_in_the_new_revision(client, store):
    resp = replace(client, "a", tgz(adapter_files(store, "b")))
    assert resp.status_code == 200 and resp.json()["status"] == "replaced", resp.text
    assert store.content_hash("a") == store.content_hash("b") == resp.json()["content_sha256"]
    fresh = replace(client, "new", tgz(adapter_files(store, "b")))
    assert fresh.status_code == 200 and fresh.json()["status"] == "uploaded"  # nothing was there to replace


def test_a_failed_replace_leaves_the_stored_revision_as_it_was(client, store):
    before = store.content_hash("a")
    broken = adapter_files(store, "b") | {"adapter_model.safetensors": b"not safetensors"}
    assert_error(replace(client, "a", tgz(broken)), 400, "adapter_import_invalid")
    assert store.content_hash("a") == before and store.names() == ["a", "b"]


def test_a_replace_that_does_not_fit_the_served_model_leaves_the_old_revision(client, state, store, tmp_path):
    state.engine = StandInEngine(info=SimpleNamespace(config=TINY))
    client.post("/v1/adapters/load", json={"name": "a"})
    other = AdapterStore(tmp_path / "other")
    big = SimpleNamespace(**dict(vars(TINY), hidden_size=32, head_dim=8))
    from kiln.adapters.compat import model_spec_from_config
    from tests.adapters.helpers import random_factors

    other.save_adapter("wide", random_factors(4, modules=["q_proj"], spec=model_spec_from_config(big)),
                       {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"})
    before = store.content_hash("a")
    assert_error(replace(client, "a", tgz(adapter_files(other, "wide"))), 400, "adapter_layout_invalid")
    assert store.content_hash("a") == before and client.get("/v1/adapters").json()["active"] == "a"


def test_replacing_the_active_adapter_keeps_it_active_at_the_new_revision(client, state, store):
    client.post("/v1/adapters/load", json={"name": "a"})
    assert replace(client, "a", tgz(adapter_files(store, "b"))).status_code == 200
    active = state.services.adapters_active
    assert active.name == "a" and active.revision == store.content_hash("b")


def test_replace_must_be_true_or_false(client, store):
    assert_error(replace(client, "a", tgz(adapter_files(store, "b")), "maybe"), 400, "adapter_import_invalid")
    assert_error(replace(client, "a", tgz(adapter_files(store, "b")), "false"), 409, "adapter_already_exists")


def test_delete_removes_an_adapter(client, store):
    assert client.delete("/v1/adapters/b").json() == {"status": "deleted", "name": "b"}
    assert store.names() == ["a"]
    assert_error(client.delete("/v1/adapters/b"), 404, "adapter_not_found")


def test_delete_of_the_active_adapter_is_409(client, store):
    client.post("/v1/adapters/load", json={"name": "a"})
    assert_error(client.delete("/v1/adapters/a"), 409, "adapter_active")


def test_load_and_unload_set_the_active_adapter(client, store):
    resp = client.post("/v1/adapters/load", json={"name": "a"})
    assert resp.json()["status"] == "loaded" and resp.json()["name"] == "a"
    assert client.get("/v1/adapters").json()["active"] == "a"
    assert client.post("/v1/adapters/unload").json() == {"status": "unloaded"}
    assert client.get("/v1/adapters").json()["active"] is None


def test_load_errors(client, store):
    assert_error(client.post("/v1/adapters/load", json={"name": "nope"}), 404, "adapter_not_found")
    assert_error(client.post("/v1/adapters/load", json={}), 400, "invalid_adapter_name")
    assert_error(client.post("/v1/adapters/load", content=b"{oops"), 400, "invalid_adapter_name")


def test_load_rejects_an_adapter_that_does_not_fit_the_served_model(client, state, store):
    other = type("Cfg", (), dict(vars(TINY), hidden_size=32, head_dim=8))
    state.engine = StandInEngine(info=SimpleNamespace(config=other))
    assert_error(client.post("/v1/adapters/load", json={"name": "a"}), 400, "adapter_layout_invalid")


def test_vllm_aliases_load_and_unload(client, store):
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "a"}).json()["name"] == "a"
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/somewhere/else"})
    assert_error(resp, 403, "lora_path_not_allowed")
    ok = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(store.root / "b")})
    assert ok.json()["name"] == "b"
    assert_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 404, "adapter_not_found")
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).json() == {"status": "unloaded"}


def test_merge_creates_a_new_adapter(client, store):
    body = {"sources": [{"name": "a", "weight": 0.5}, {"name": "b", "weight": 0.5}], "output_name": "m"}
    resp = client.post("/v1/adapters/merge", json=body)
    assert resp.json() == {"status": "merged", "output_name": "m", "mode": "weighted_average",
                           "sources": body["sources"], "num_tensors": 8}
    assert "m" in store.names()


def test_merge_errors_are_envelopes(client, store):
    src = [{"name": "a", "weight": 1.0}]
    assert_error(client.post("/v1/adapters/merge", json={"sources": src}), 400, "adapter_merge_invalid")
    assert_error(client.post("/v1/adapters/merge", json={"sources": src, "output_name": "m", "mode": "x"}), 400,
                 "adapter_merge_invalid")
    assert_error(client.post("/v1/adapters/merge", json={"sources": [{"name": "a", "weight": "heavy"}],
                                                         "output_name": "m"}), 400, "adapter_merge_invalid")
    assert_error(client.post("/v1/adapters/merge", json={"sources": src, "output_name": "b"}), 409,
                 "adapter_merge_output_exists")
    assert_error(client.post("/v1/adapters/merge", json={"sources": src, "output_name": "../m"}), 400,
                 "adapter_merge_bad_name")


TRAVERSAL_SEGMENTS = ["%2E%2E", "..hidden", "a..b", ".hidden", "a%5Cb", "%20a"]


@pytest.mark.parametrize("segment", TRAVERSAL_SEGMENTS)
@pytest.mark.parametrize("method,path", [("GET", "/v1/adapters/{}/detail"), ("GET", "/v1/adapters/{}/download"),
                                         ("GET", "/v1/adapters/{}/receipt"), ("DELETE", "/v1/adapters/{}")])
def test_path_names_are_validated_on_every_route(client, store, method, path, segment):
    assert_error(client.request(method, path.format(segment)), 400, "invalid_adapter_name")


@pytest.mark.parametrize("method,path", [("GET", "/v1/adapters/..%2F..%2Fetc/detail"),
                                         ("DELETE", "/v1/adapters/a%2F..%2Fb")])
def test_encoded_slashes_never_reach_a_handler(client, store, method, path):
    resp = client.request(method, path)
    assert resp.status_code in (400, 404) and set(resp.json()["error"]) == ERROR_KEYS
    assert store.names() == ["a", "b"]


@pytest.mark.parametrize("bad", ["../a", "a/b", "..", ".x", "a\\b", ""])
def test_body_names_are_validated_on_every_route(client, store, bad):
    assert_error(client.post("/v1/adapters/load", json={"name": bad}), 400, "invalid_adapter_name")
    assert_error(client.post("/v1/load_lora_adapter", json={"lora_name": bad}), 400, "invalid_adapter_name")
    assert_error(upload(client, bad, tgz(adapter_files(store))), 400, "invalid_adapter_name")
    merge = {"sources": [{"name": bad, "weight": 1.0}], "output_name": "m"}
    assert_error(client.post("/v1/adapters/merge", json=merge), 400, "invalid_adapter_name")
    assert store.names() == ["a", "b"]


def test_vllm_load_imports_an_outside_lora_path_when_the_operator_allows_it(client, state, store, tmp_path):
    outside = AdapterStore(tmp_path / "outside")
    save_random(outside, "trained", r=2, alpha=4, modules=["q_proj"], seed=9)
    body = {"lora_name": "imported", "lora_path": str(outside.path("trained"))}
    assert_error(client.post("/v1/load_lora_adapter", json=body), 403, "lora_path_not_allowed")
    assert not store.exists("imported")
    state.settings.server.allow_external_lora_paths = True
    resp = client.post("/v1/load_lora_adapter", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["name"] == "imported" and store.content_hash("imported") == outside.content_hash("trained")
    assert client.get("/v1/adapters").json()["active"] == "imported"


def test_vllm_load_of_an_outside_path_that_is_no_adapter_is_a_400(client, state, tmp_path):
    state.settings.server.allow_external_lora_paths = True
    (tmp_path / "junk").mkdir()
    body = {"lora_name": "x", "lora_path": str(tmp_path / "junk")}
    assert_error(client.post("/v1/load_lora_adapter", json=body), 400, "adapter_import_invalid")
