"""The teacher registry on real `kiln serve` processes with tiny models: local teachers, remote teachers
verified over HTTP (same tokenizer accepted, a different one refused with 409, keys outside loopback),
aliases immutable, bad registrations 400 and never recorded."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from .conftest import RunningServer, free_port, start_server, stop_server

pytestmark = pytest.mark.e2e

KEY = "sk-teacher-e2e"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, RunningServer]]:
    from kiln.testing.tiny import make_tiny_model

    other = make_tiny_model(tmp_path_factory.mktemp("other-tok") / "m", arch="llama", init_std=0.3)
    path = other / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["H"], vocab["e"] = vocab["e"], vocab["H"]   # same size, two ids swapped: another tokenizer
    path.write_text(json.dumps(data))
    started: dict[str, RunningServer] = {}
    try:
        started["student"] = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("student"),
                                          "--served-model-id", "tiny", env={"KILN_TEACHER_KEY": KEY})
        started["same"] = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("same"), "--served-model-id",
                                       "tiny-teacher", "--api-key", KEY)
        started["other"] = start_server(str(other), tmp_path_factory.mktemp("other"), "--served-model-id", "other")
        yield started
    finally:
        for server in started.values():
            stop_server(server)


def register(servers, **body) -> httpx.Response:
    return httpx.post(servers["student"].url + "/v1/teachers", json=body, timeout=60)


def aliases(servers) -> list[str]:
    return [t["alias"] for t in httpx.get(servers["student"].url + "/v1/teachers", timeout=10).json()["teachers"]]


def assert_error(resp: httpx.Response, status: int, code: str, param: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == (code, param) and err["hint"], err
    return err


def test_a_local_teacher_is_recorded_with_its_identity_and_its_alias_is_immutable(servers):
    r = register(servers, alias="self", kind="local")
    assert r.status_code == 200, r.text
    record = r.json()
    assert record["kind"] == "local" and record["identity"]["base_model_sha256"].startswith("sha256:")
    assert record["identity"]["tokenizer_probe_sha256"].startswith("sha256:") and "self" in aliases(servers)
    assert_error(register(servers, alias="self", kind="local"), 409, "teacher_exists", "alias")
    assert httpx.delete(servers["student"].url + "/v1/teachers/self", timeout=10).json() == {
        "status": "deleted", "alias": "self"}
    assert_error(httpx.delete(servers["student"].url + "/v1/teachers/self", timeout=10), 404, "teacher_not_found",
                 "alias")


def test_a_remote_teacher_with_the_same_tokenizer_and_its_key_is_accepted(servers):
    r = register(servers, alias="remote", kind="remote", url=servers["same"].url + "/v1/", api_key_env="KILN_TEACHER_KEY")
    assert r.status_code == 200, r.text
    record = r.json()
    assert record["url"] == servers["same"].url and record["identity"]["model_id"] == "tiny-teacher"
    assert "remote" in aliases(servers) and KEY not in json.dumps(record)
    local = register(servers, alias="local-probe", kind="local").json()
    assert record["identity"]["tokenizer_probe_sha256"] == local["identity"]["tokenizer_probe_sha256"]


def test_a_remote_teacher_with_another_tokenizer_is_a_409_and_not_recorded(servers):
    err = assert_error(register(servers, alias="other", kind="remote", url=servers["other"].url), 409,
                       "teacher_tokenizer_mismatch", "url")
    assert "differs" in err["message"] and "other" not in aliases(servers)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"kind": "local", "adapter": "missing"}, "adapter", "not found"),
    ({"kind": "local", "url": "http://127.0.0.1:1"}, "url", "takes no url"),
    ({"kind": "remote"}, "url", "needs url"),
    ({"kind": "remote", "url": "ftp://127.0.0.1/"}, "url", "not an http"),
    ({"kind": "remote", "url": "http://10.1.2.3:8000"}, "api_key_env", "outside loopback"),
    ({"kind": "remote", "url": "http://10.1.2.3:8000", "api_key_env": "KILN_NOT_SET_ANYWHERE"}, "api_key_env",
     "not set"),
    ({"kind": "remote", "url": f"http://127.0.0.1:{free_port()}"}, "url", "did not answer"),
])
def test_bad_registrations_are_400s_naming_the_field(servers, body, param, says):
    err = assert_error(register(servers, alias="bad", **body), 400, "teacher_invalid", param)
    assert says in err["message"] and "bad" not in aliases(servers)


def test_a_remote_teacher_needs_its_key_and_a_model_it_serves(servers):
    no_key = register(servers, alias="bad", kind="remote", url=servers["same"].url)
    assert "with 401" in assert_error(no_key, 400, "teacher_invalid", "url")["message"]
    wrong_model = register(servers, alias="bad", kind="remote", url=servers["same"].url, model_id="nope",
                           api_key_env="KILN_TEACHER_KEY")
    assert_error(wrong_model, 400, "teacher_invalid", "model_id")
    assert "bad" not in aliases(servers)
