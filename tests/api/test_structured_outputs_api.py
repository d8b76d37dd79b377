"""Structured outputs over HTTP on the tiny model: the constraint fields are honoured or refused with a
400 naming them, never ignored, and every response keeps the contract's exact shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.testing.schemas import validate
from tests.api.tiny_server import tiny_server

INF = "kiln-inference-v1.schema.json"
MSG = [{"role": "user", "content": "Go."}]
ROUTERS = ["kiln.api.routers.system", "kiln.api.routers.chat", "kiln.api.routers.batch", "kiln.api.routers.metrics"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# the tiny server's context is 320 tokens: each test sends the tools it needs
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("structured"), ROUTERS) as served:
        yield served


@pytest.fixture
def client(served):
    return served.client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 80, "seed": 3, **body})


def ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(INF, "ChatCompletionResponse", body)
    return body


def refused(resp, param: str) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "hint"}
    assert err["param"] == param and err["code"] == "chat_invalid_request" and err["hint"]
    return err


def test_json_schema_response_format_gives_content_that_validates(client):
    body = ok(chat(client, n=2, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}))
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_response_format_gives_an_object(client):
    body = ok(chat(client, max_tokens=120, response_format={"type": "json_object"}))
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:   # a free-form object may run to max_tokens; what there is still is JSON so far
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"choice": ["red", "green"]}},
    {"guided_choice": ["red", "green"]},
    {"structured_outputs": {"grammar": 'start: "red" | "green"'}},
    {"grammar": 'root ::= "red" | "green"'},
])
def test_vllm_and_llama_cpp_constraint_fields(client, fields):
    body = ok(chat(client, **fields))
    assert body["choices"][0]["message"]["content"] in ("red", "green")


def test_llama_cpp_top_level_json_schema(client):
    body = ok(chat(client, json_schema=PERSON))
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


def test_streamed_structured_output_assembles_to_valid_json(client):
    text, finish = "", None
    body = {"messages": MSG, "max_tokens": 80, "seed": 4, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                validate(INF, "ChatCompletionChunk", chunk)
                for c in chunk["choices"]:
                    text += c["delta"].get("content") or ""
                    finish = c.get("finish_reason") or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_tool_choice_required_gives_a_tool_call_with_valid_arguments(client):
    body = ok(chat(client, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", (body["usage"], choice)
    (call,) = choice["message"]["tool_calls"]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_a_named_tool_choice_calls_that_function(client):
    body = ok(chat(client, tools=TOOLS[1:], tool_choice={"type": "function", "function": {"name": "time"}}))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["time"]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["zone"] in ("UTC", "CET")


def test_tool_choice_none_never_gives_a_tool_call(client):
    body = ok(chat(client, tools=TOOLS[:1], tool_choice="none", max_tokens=40))
    assert "<tool_call>" not in body["choices"][0]["message"]["content"]


def test_the_batch_endpoint_honours_response_format(client):
    resp = client.post("/v1/completions/batch", json={
        "prompts": [MSG, [{"role": "user", "content": "Another person."}]], "max_tokens": 80, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(INF, "BatchCompletionResponse", body)
    for item in body["completions"]:
        jsonschema.validate(json.loads(item["text"]), PERSON)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"grammar": 'start: "a" missing_rule'}, "grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_constraints_that_cannot_be_met_are_400s_naming_the_field(client, fields, param):
    refused(chat(client, **fields), param)


def test_a_schema_that_compiles_past_the_deadline_is_a_400_naming_the_field(served, monkeypatch):
    monkeypatch.setattr(served.state.engine.grammars, "timeout_s", 0.05)
    slow = {"type": "array", "maxItems": 2000,
            "prefixItems": [{"type": "integer", "minimum": i * 7919, "maximum": i * 104729 + 13} for i in range(2000)]}
    err = refused(chat(served.client, response_format={"type": "json_schema", "json_schema": {
        "name": "slow", "schema": slow}}), "response_format.json_schema.schema")
    assert "did not compile within" in err["message"]
    lines = dict(line.split(" ", 1) for line in served.client.get("/metrics").text.splitlines()
                 if line.startswith("kiln_structured_refusals_total"))
    assert float(lines['kiln_structured_refusals_total{reason="timeout"}']) >= 1


def test_metrics_count_structured_requests_refusals_and_mask_time(client):
    ok(chat(client, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    refused(chat(client, response_format={"type": "yaml"}), "response_format.type")
    text = client.get("/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if line.startswith("kiln_structured")}
    assert lines['kiln_structured_requests_total{kind="json_schema"}'] >= 1
    assert lines['kiln_structured_refusals_total{reason="invalid_field"}'] >= 1
    assert lines["kiln_structured_mask_seconds_total"] > 0
    assert lines["kiln_structured_mask_rows_total"] >= 1


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A tiny Qwen3-style model whose prompt opens a reasoning block, its vocabulary wider than its tokenizer's."""
    from fastapi.testclient import TestClient

    from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
    from kiln.engine.build import build_engine
    from kiln.server import build_server
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("thinking")
    model = make_tiny_model(root / "q", arch="qwen3", init_std=0.3, thinking_prompt=True, extra_vocab=7)
    settings = Settings(model=ModelSettings(path=str(model), dtype="float32", served_model_id="q"),
                        data=DataSettings(data_dir=str(root / "data")), engine=EngineSettings(kv_cache_memory_mb=8))
    server = build_server(settings, routers=ROUTERS)
    server.publish(build_engine(settings))
    try:
        yield TestClient(server.app)
    finally:
        server.close()


def test_on_a_thinking_prompt_the_grammar_applies_after_the_reasoning(thinking):
    body = ok(thinking.post("/v1/chat/completions", json={
        "messages": MSG, "max_tokens": 60, "seed": 2, "thinking_budget_tokens": 6,
        "structured_outputs": {"choice": ["alpha", "beta"]}}))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"]   # free text, not held to the grammar
    assert message["content"] in ("alpha", "beta")
    assert body["choices"][0]["finish_reason"] == "stop"
