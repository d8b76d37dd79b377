"""The OpenAI-compatible eval generator against a scripted HTTP transport (no server process)."""

from __future__ import annotations

import asyncio
import json

import httpx

from kiln.core.thinking_budget import resolve_budget
from kiln.evals.generator import GenerationRequest
from kiln.evals.remote_generator import RemoteGenerator, raw_text, request_body

BASE = "http://remote.test/v1"


def reply(content="4", *, reasoning=None, tool_calls=None, finish="stop", metadata=None):
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    body = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message,
                                                                   "finish_reason": finish}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}
    if metadata is not None:
        body["metadata"] = metadata
    return body


def generator(handler) -> RemoteGenerator:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RemoteGenerator(BASE, client=client)


def models_or(chat):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served-model"}]})
        return chat(request)

    return handler


def test_each_request_is_one_chat_completion_with_explicit_decode_params():
    seen = []

    def chat(request):
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=reply("4"))

    req = GenerationRequest(messages=[{"role": "user", "content": "2 + 2?"}], temperature=0.7, top_p=0.9, top_k=5,
                            max_tokens=12, stop=["\n"], seed=123, label="a#0")
    results = asyncio.run(generator(models_or(chat)).generate([req, req]))
    assert [r.text for r in results] == ["4", "4"]
    assert (results[0].prompt_tokens, results[0].completion_tokens) == (9, 3)
    body = seen[0]
    assert body["model"] == "served-model"
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 12, "stop": ["\n"], "seed": 123}
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (0.0, 0.0, 1.0)


def test_only_explicit_thinking_budgets_are_sent():
    explicit = resolve_budget({"thinking_budget_tokens": 8, "thinking_budget_ms": None}, {}, scope="suite")
    body = request_body("m", GenerationRequest(messages=[], thinking_budget=explicit))
    assert (body["thinking_budget_tokens"], body["thinking_budget_ms"]) == (8, None)
    inherited = resolve_budget({}, {"default_thinking_budget_tokens": 64}, scope="suite")
    assert "thinking_budget_tokens" not in request_body("m", GenerationRequest(messages=[], thinking_budget=inherited))


def test_reasoning_and_tool_calls_are_rebuilt_into_the_raw_text():
    message = {"content": "Calling.", "reasoning_content": "need weather",
               "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                "arguments": "{\"city\": \"Paris\"}"}}]}
    assert raw_text(message) == ("<think>\nneed weather\n</think>\n\nCalling.\n<tool_call>\n"
                                 "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")


def test_http_errors_become_failed_results_with_the_server_message():
    def chat(request):
        return httpx.Response(400, json={"error": {"message": "bad stop", "code": "chat_invalid_request"}})

    result = asyncio.run(generator(models_or(chat)).generate([GenerationRequest(messages=[])]))[0]
    assert result.error == "generation failed: HTTP 400: bad stop"
    assert result.finish_reason == "error"


def test_kiln_thinking_budget_metadata_is_kept():
    record = {"configured": True, "applied": True, "max_tokens": 4, "tokens_source": "request",
              "time_source": "unlimited", "triggered": True, "trigger": "tokens", "closed": True,
              "thinking_tokens": 4, "thinking_time_ms": 3}

    def chat(request):
        return httpx.Response(200, json=reply("ok", metadata={"thinking_budget": record}))

    result = asyncio.run(generator(models_or(chat)).generate([GenerationRequest(messages=[])]))[0]
    assert result.thinking_budget == record


def test_identity_names_the_remote_server_and_model():
    identity = asyncio.run(generator(models_or(lambda r: httpx.Response(500))).identity())
    assert identity.execution_provenance["base_url"] == BASE
    assert identity.base_weight_manifest["model"] == "served-model"
