"""Suite registry routes (semantics.md §1.5), every response checked against the evals contract."""

import json

import pytest
from fastapi.testclient import TestClient

from kiln.config import Settings
from kiln.server import build_server
from kiln.testing.schemas import validate
from tests.evals._helpers import suite_json

SCHEMA = "kiln-evals-v1.schema.json"


@pytest.fixture
def client(tmp_path):
    settings = Settings()
    settings.data.data_dir = str(tmp_path)
    with TestClient(build_server(settings).app) as c:
        yield c


def error_of(resp, status, code):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == code and body["hint"]
    return body


def test_register_creates_then_conflicts_then_overwrites_with_force(client, tmp_path):
    resp = client.post("/v1/eval/suites", json=suite_json())
    assert resp.status_code == 200
    validate(SCHEMA, "SuiteSaveResponse", resp.json())
    assert resp.json()["status"] == "created"
    assert resp.json()["path"] == str(tmp_path / "eval" / "suites" / "math-smoke" / "suite.json")

    error_of(client.post("/v1/eval/suites", json=suite_json()), 409, "eval_suite_exists")

    resp = client.post("/v1/eval/suites?force=true", json=suite_json(description="v2"))
    validate(SCHEMA, "SuiteSaveResponse", resp.json())
    assert resp.json()["status"] == "overwritten"


def test_list_returns_summaries(client):
    client.post("/v1/eval/suites", json=suite_json(name="b"))
    client.post("/v1/eval/suites", json=suite_json(name="a"))
    body = client.get("/v1/eval/suites").json()
    validate(SCHEMA, "SuiteListResponse", body)
    assert [s["name"] for s in body["suites"]] == ["a", "b"]
    assert body["suites"][0]["tags"] == {"easy": 1, "math": 2}


def test_list_is_empty_before_anything_is_registered(client):
    body = client.get("/v1/eval/suites").json()
    validate(SCHEMA, "SuiteListResponse", body)
    assert body == {"suites": []}


def test_get_returns_the_stored_suite(client):
    client.post("/v1/eval/suites", json=suite_json(colour="ignored"))
    body = client.get("/v1/eval/suites/math-smoke").json()
    validate(SCHEMA, "EvalSuite", body)
    assert body == {k: v for k, v in suite_json().items()}


def test_delete_then_get_is_404(client):
    client.post("/v1/eval/suites", json=suite_json())
    resp = client.delete("/v1/eval/suites/math-smoke")
    validate(SCHEMA, "DeleteSuiteResponse", resp.json())
    assert resp.json() == {"status": "deleted", "name": "math-smoke"}
    error_of(client.get("/v1/eval/suites/math-smoke"), 404, "eval_suite_not_found")
    error_of(client.delete("/v1/eval/suites/math-smoke"), 404, "eval_suite_not_found")


def test_invalid_example_is_400_naming_example_and_field(client):
    data = suite_json()
    data["examples"][1]["weight"] = -1
    body = error_of(client.post("/v1/eval/suites", json=data), 400, "eval_invalid_request")
    assert body["param"] == "examples[1].weight"
    assert body["message"].startswith("Invalid eval request: example three-plus-three: weight")


def test_bad_suite_name_is_400_invalid_suite_name(client):
    body = error_of(client.post("/v1/eval/suites", json=suite_json(name="a..b")), 400, "invalid_suite_name")
    assert body["param"] == "name"
    error_of(client.get("/v1/eval/suites/.hidden"), 400, "invalid_suite_name")


@pytest.mark.parametrize("body", [b"", b"{oops", b"[1, 2]", b'{"name": "x", "default_scorer": {"kind": "exact_match"},'
                                  b' "examples": [{"messages": [{"role": "user", "content": "x"}], "weight": NaN}]}'])
def test_malformed_bodies_are_400(client, body):
    resp = client.post("/v1/eval/suites", content=body, headers={"content-type": "application/json"})
    error_of(resp, 400, "eval_invalid_request")


def test_oversized_body_is_413(client):
    resp = client.post("/v1/eval/suites", content=b" " * 10,
                       headers={"content-type": "application/json", "content-length": str(33 * 1024 * 1024)})
    error_of(resp, 413, "eval_invalid_request")


def test_stored_file_is_the_suite_json(client, tmp_path):
    client.post("/v1/eval/suites", json=suite_json())
    stored = json.loads((tmp_path / "eval" / "suites" / "math-smoke" / "suite.json").read_text())
    assert stored["name"] == "math-smoke" and len(stored["examples"]) == 2
