"""Every JSON body and SSE event the inference endpoints emit, validated against its entrypoint in
kiln/contracts/kiln-inference-v1.schema.json, on a plain model and on one that prompts inside <think>.

The request bodies are validated against their request entrypoints too, so the cases exercise the
contract as a client would write it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

INF = "kiln-inference-v1.schema.json"
pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Think about the sea, then answer."}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}]
ERROR_KEYS = {"message", "type", "param", "code", "hint"}


@pytest.fixture(scope="module", params=["plain", "thinking"])
def server(request, tmp_path_factory):
    if request.param == "plain":
        yield request.getfixturevalue("tiny_server")
        return
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("conf-q3") / "tiny-qwen3", arch="qwen3", init_std=0.3,
                            thinking_prompt=True)
    srv = start_server(str(model), tmp_path_factory.mktemp("conf-srv"), "--served-model-id", "tiny-qwen3")
    yield srv
    stop_server(srv)


def post(server, path: str, body: dict, entrypoint: str | None = None) -> httpx.Response:
    if entrypoint is not None:
        validate(INF, entrypoint, body)
    return httpx.post(server.base_url + path, json=body, timeout=120)


def stream_events(server, body: dict) -> list[dict | str]:
    validate(INF, "ChatCompletionRequest", body)
    events: list[dict | str] = []
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


CHAT_CASES = {
    "plain": {"max_tokens": 8, "temperature": 0},
    "n3_seeded": {"max_tokens": 6, "n": 3, "seed": 17, "temperature": 0.9},
    "performance_and_hashes": {"max_tokens": 6, "include_performance": True, "include_config_hashes": True},
    "rollout_provenance": {"max_tokens": 6, "seed": 3, "rollout_provenance": True},
    "budgeted_provenance": {"max_tokens": 12, "seed": 3, "rollout_provenance": True, "thinking_budget_tokens": 2},
    "thinking_budget": {"max_tokens": 12, "thinking_budget_tokens": 1, "thinking_budget_ms": None},
    "fold": {"max_tokens": 12, "thinking_budget_tokens": 2, "fold_reasoning_into_content": True},
    "tools": {"max_tokens": 8, "tools": TOOLS, "tool_choice": "auto"},
    "zero_tokens": {"max_tokens": 0},
    "stop_and_preset": {"max_tokens": 8, "stop": ["e", "a"], "sampling_preset": "greedy"},
    "completion_alias": {"max_tokens": None, "max_completion_tokens": 4, "ignore_eos": True},
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_json_body_matches_the_schema(server, case):
    r = post(server, "/chat/completions", {"messages": MSG, **CHAT_CASES[case]}, "ChatCompletionRequest")
    assert r.status_code == 200, r.text
    validate(INF, "ChatCompletionResponse", r.json())


STREAM_CASES = {
    "plain": {"max_tokens": 8, "temperature": 0},
    "usage": {"max_tokens": 6, "stream_options": {"include_usage": True}},
    "token_timing": {"max_tokens": 6, "include_performance": True, "stream_options": {"include_usage": True}},
    "thinking_budget": {"max_tokens": 12, "thinking_budget_tokens": 1, "include_performance": True},
    "tools": {"max_tokens": 8, "tools": TOOLS},
    "zero_tokens": {"max_tokens": 0},
}


@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_chat_stream_events_match_the_schema(server, case):
    body = {"messages": MSG, "stream": True, **STREAM_CASES[case]}
    events = stream_events(server, body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [e for e in events[:-1] if e.get("object") == "chat.completion.chunk"]
    timings = [e for e in events[:-1] if e.get("object") == "kiln.token_timing"]
    assert len(chunks) + len(timings) == len(events) - 1
    for c in chunks:
        validate(INF, "ChatCompletionChunk", c)
    for t in timings:
        validate(INF, "StreamingTokenTiming", t)
    terminal = [i for i, c in enumerate(events[:-1]) if isinstance(c, dict) and c.get("choices")
                and "finish_reason" in c["choices"][0]]
    assert len(terminal) == 1
    after = events[terminal[0] + 1:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["choices"] == [] and "usage" in c for c in after)
    assert "thinking_budget" in events[terminal[0]]["metadata"]
    if body.get("include_performance"):
        assert [t["token_index"] for t in timings] == list(range(len(timings))) and timings
        if after:
            assert len(timings) == after[0]["usage"]["completion_tokens"]
        assert "performance" in events[terminal[0]]["metadata"]
    else:
        assert not timings


def test_stream_and_json_agree_for_the_same_seeded_request(server):
    req = {"messages": MSG, "max_tokens": 14, "seed": 21, "temperature": 0.8, "include_performance": True}
    plain = post(server, "/chat/completions", req, "ChatCompletionRequest").json()
    content, reasoning = "", ""
    for e in stream_events(server, {**req, "stream": True})[:-1]:
        if e["object"] == "chat.completion.chunk" and e["choices"]:
            content += e["choices"][0]["delta"].get("content", "")
            reasoning += e["choices"][0]["delta"].get("reasoning_content", "")
    msg = plain["choices"][0]["message"]
    assert content == msg["content"] and reasoning == msg.get("reasoning_content", "")


BATCH_CASES = {
    "n2_seeded": {"prompts": [MSG, [{"role": "user", "content": "Name a color."}]], "n": 2, "max_tokens": 6,
                  "seed": 4},
    "budget": {"prompts": [MSG], "max_tokens": 12, "thinking_budget_tokens": 2},
    "zero_tokens": {"prompts": [MSG, MSG], "max_tokens": 0},
    "failing_item": {"prompts": [MSG, [{"role": "user", "content": "word " * 3000}]], "max_tokens": 3},
    "tools": {"prompts": [MSG], "max_tokens": 6, "tools": TOOLS, "adapter": None},
}


@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_batch_body_matches_the_schema(server, case):
    r = post(server, "/completions/batch", BATCH_CASES[case], "BatchCompletionRequest")
    assert r.status_code == 200, r.text
    validate(INF, "BatchCompletionResponse", r.json())


@pytest.mark.parametrize("body", [
    {"prompt": "The sea is wide.", "prompt_logprobs": 3},
    {"prompt": [5, 17, 300, 42], "prompt_logprobs": 0, "max_tokens": 0, "n": None, "stream": False},
    {"prompt": "x", "prompt_logprobs": 1, "add_special_tokens": False},
], ids=["text", "ids", "single_token"])
def test_completions_body_matches_the_schema(server, body):
    r = post(server, "/completions", body, "TextCompletionRequest")
    assert r.status_code == 200, r.text
    validate(INF, "TextCompletionResponse", r.json())


ERROR_CASES = [
    ("/chat/completions", {"messages": MSG, "n": 2, "stream": True}),
    ("/chat/completions", {"messages": MSG, "adapter": "missing"}),
    ("/chat/completions", {"messages": MSG, "rollout_provenance": True, "ignore_eos": True}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}),
    ("/completions/batch", {"prompts": [MSG] * 65}),
    ("/completions/batch", {"prompts": []}),
    ("/completions", {"prompt": "x", "prompt_logprobs": 300}),
    ("/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), ERROR_CASES)
def test_errors_use_the_envelope_and_name_the_field(server, path, body):
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == ERROR_KEYS
    assert err["code"] and err["message"] and err["hint"] and err["param"]


def test_invalid_stream_request_is_rejected_before_any_event(server):
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": MSG, "stream": True, "n": 2},
                   timeout=30)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
