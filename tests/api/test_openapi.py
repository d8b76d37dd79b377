"""/openapi.json carries every contract entrypoint's body schema, referenced from kiln/contracts."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from kiln.api.app import create_app
from kiln.api.openapi import CONTRACT_OPERATIONS, ERROR_COMPONENT, component_names, contract_entrypoints
from kiln.config import DataSettings, Settings
from kiln.contracts import schemas
from kiln.server import build_state


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path_factory.mktemp("openapi"))))
    client = TestClient(create_app(settings, build_state(settings)))
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _entrypoints() -> set[tuple[str, str]]:
    return {(file, name) for file, data in schemas().items() for name in data.get("x-kiln-entrypoints", [])}


def test_every_contract_entrypoint_belongs_to_a_route():
    assert contract_entrypoints() == _entrypoints()
    json_entrypoints = {e for e in _entrypoints() if e[1] != "ChatCompletionChunkStream"}
    assert len(json_entrypoints) == 39


def test_every_contract_route_has_its_request_and_response_schema(doc):
    for op in CONTRACT_OPERATIONS:
        operation = doc["paths"][op.path][op.method]
        if op.request is not None:
            schema = operation["requestBody"]["content"][op.request_media]["schema"]
            assert schema == {"$ref": f"#/components/schemas/{component_names()[(op.file, op.request)]}"}
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].endswith("/" + component_names()[(op.file, op.response)])
        assert "503" in operation["responses"]


def test_components_are_the_contract_definitions_with_refs_rewritten(doc):
    components = doc["components"]["schemas"]
    inference = schemas()["kiln-inference-v1.schema.json"]["$defs"]
    assert components["ChatCompletionRequest"]["properties"].keys() == inference["ChatCompletionRequest"]["properties"].keys()
    assert "ThinkingBudget.record" in components and ERROR_COMPONENT in components
    refs = re.findall(r'"\$ref": "([^"]*)"', json.dumps(doc))
    assert refs and all(r.startswith("#/components/schemas/") for r in refs)


def test_every_ref_in_the_document_resolves(doc):
    def walk(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                target = doc
                for part in ref.removeprefix("#/").split("/"):
                    target = target[part.replace("~1", "/").replace("~0", "~")]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)


def test_path_parameters_are_declared(doc):
    params = doc["paths"]["/v1/eval/jobs/{job_id}"]["get"]["parameters"]
    assert {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}} in params \
        or any(p["name"] == "job_id" and p["in"] == "path" for p in params)


def test_swagger_ui_is_served(tmp_path):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path)))
    client = TestClient(create_app(settings, build_state(settings)))
    assert client.get("/docs").status_code == 200


def test_swagger_ui_loads_nothing_from_another_host(tmp_path):
    settings = Settings(data=DataSettings(data_dir=str(tmp_path)))
    client = TestClient(create_app(settings, build_state(settings)))
    page = client.get("/docs").text
    assert not re.findall(r"https?://", page), "the docs page reaches outside the server"
    assets = re.findall(r"""(?:src|href)=["']?(/docs/static/[^"' >]+)""", page)
    assert {a.rsplit("/", 1)[1] for a in assets} >= {"swagger-ui-bundle.js", "swagger-ui.css"}
    for asset in assets:
        assert client.get(asset).status_code == 200, asset


def _resolved(doc, schema):
    while isinstance(schema, dict) and "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def test_every_v1_post_and_put_documents_its_body_fields_or_says_it_has_none(doc):
    seen = 0
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method not in ("post", "put") or not path.startswith("/v1/"):
                continue
            seen += 1
            if operation.get("x-kiln-bodiless"):
                assert "requestBody" not in operation, (method, path)
                continue
            assert "requestBody" in operation, f"{method.upper()} {path} documents no body"
            for media, content in operation["requestBody"]["content"].items():
                schema = _resolved(doc, content.get("schema"))
                assert schema and schema.get("properties"), f"{method.upper()} {path} ({media}): {schema}"
    assert seen >= 40  # every router is mounted: the walk saw them all


def test_bodiless_routes_are_the_ones_that_read_no_body(doc):
    bodiless = {(m, p) for p, item in doc["paths"].items() for m, op in item.items() if op.get("x-kiln-bodiless")}
    assert bodiless == {("post", "/v1/adapters/unload"), ("post", "/v1/replicas/{name}/check"),
                        ("post", "/v1/train/jobs/{job_id}/resume")}


def test_new_routes_show_their_wire_models(doc):
    def fields(method, path, media="application/json"):
        body = doc["paths"][path][method]["requestBody"]
        return set(_resolved(doc, body["content"][media]["schema"])["properties"]), body["required"]

    from kiln.replicas.spec import FIELDS

    assert fields("post", "/v1/replicas") == (set(FIELDS), True)
    assert fields("post", "/v1/adapters/{name}/publish") == ({"replicas", "activate"}, True)
    assert fields("post", "/v1/adapters/{name}/unpublish") == ({"replicas"}, False)
    assert fields("post", "/v1/adapters/upload", "multipart/form-data") == ({"name", "archive", "replace"}, True)
    assert {"examples", "config", "post_eval"} <= fields("post", "/v1/train/sft")[0]
    assert fields("post", "/v1/train/hf/peft/imports/{name}") == ({"path"}, True)
    assert "name" in fields("post", "/v1/train/hf/dpo/exports")[0] and "config" in fields("post", "/v1/train/opd")[0]
