"""The real server on a tiny generated model, through httpx and the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from kiln.testing.schemas import validate

INF = "kiln-inference-v1.schema.json"
pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "Tell me a story about a small dog."}]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


def sse_events(server, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_non_streaming_completion_is_schema_valid(tiny_server):
    r = post(tiny_server, {"model": "tiny", "messages": MSG, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    validate(INF, "ChatCompletionResponse", body)
    assert body["model"] == "tiny"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 12


def test_streaming_sends_role_deltas_terminal_and_done(tiny_server):
    body = {"messages": MSG, "max_tokens": 10, "temperature": 0, "stream": True}
    events = sse_events(tiny_server, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        validate(INF, "ChatCompletionChunk", c)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("finish_reason" not in c["choices"][0] for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = post(tiny_server, {"messages": MSG, "max_tokens": 10, "temperature": 0}).json()
    assert streamed == plain["choices"][0]["message"]["content"]


def test_include_usage_adds_a_usage_only_chunk_before_done(tiny_server):
    body = {"messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(tiny_server, body)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    validate(INF, "ChatCompletionChunk", usage_chunk)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["total_tokens"] == (
        usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"])
    assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length")


def test_n_2_returns_two_choices_with_distinct_seeds(tiny_server):
    r = post(tiny_server, {"messages": MSG, "max_tokens": 16, "n": 2, "seed": 7, "temperature": 1.0})
    assert r.status_code == 200, r.text
    body = r.json()
    validate(INF, "ChatCompletionResponse", body)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # choice 1 uses seed + 1: the same as choice 0 of a request seeded 8
    r8 = post(tiny_server, {"messages": MSG, "max_tokens": 16, "seed": 8, "temperature": 1.0}).json()
    assert body["choices"][1]["message"]["content"] == r8["choices"][0]["message"]["content"]


def test_same_seed_gives_byte_identical_output(tiny_server):
    body = {"messages": MSG, "max_tokens": 24, "seed": 1234, "temperature": 1.0, "top_p": 0.9}
    a = post(tiny_server, body).json()["choices"][0]["message"]["content"]
    b = post(tiny_server, body).json()["choices"][0]["message"]["content"]
    assert a == b


def test_stop_sequence_is_not_returned_and_finishes_with_stop(tiny_server):
    full = post(tiny_server, {"messages": MSG, "max_tokens": 24, "temperature": 0}).json()
    text = full["choices"][0]["message"]["content"]
    assert len(text) >= 4
    stop = text[2:4]
    r = post(tiny_server, {"messages": MSG, "max_tokens": 24, "temperature": 0, "stop": [stop]}).json()
    out = r["choices"][0]["message"]["content"]
    assert stop not in out
    assert out == text[: text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_bad_request_is_a_400_with_the_error_envelope(tiny_server):
    r = post(tiny_server, {"messages": MSG, "n": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "hint"}
    assert err["param"] == "n"
    r = httpx.post(tiny_server.base_url + "/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400
    r = post(tiny_server, {"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_unknown_fields_are_ignored(tiny_server):
    r = post(tiny_server, {"messages": MSG, "max_tokens": 2, "logit_bias": {}, "user": "x", "frobnicate": 1})
    assert r.status_code == 200, r.text


def test_models_lists_the_served_model(tiny_server):
    body = httpx.get(tiny_server.base_url + "/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "tiny"


def test_openai_client_non_streaming_and_streaming(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.base_url, api_key="unused")
    resp = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == resp.choices[0].message.content
    assert usage is not None and usage.completion_tokens == resp.usage.completion_tokens


@pytest.fixture(scope="module")
def quantized_server(tiny_model_dir, tmp_path_factory):
    """The tiny model served with q4_1 weights: decode-only steps run in the C++ DecodeStack."""
    from .conftest import start_server, stop_server

    server = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("srv-q4"), "--served-model-id", "tiny",
                          "--quantization", "q4_1")
    yield server
    stop_server(server)


def _concurrent_and_sequential(server) -> tuple[list[str], list[str]]:
    prompts = [f"Request number {i}: write about the sea and the number {i * 7}." for i in range(16)]

    def body(p: str) -> dict:
        return {"messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0, "stream": True}

    async def one(client: httpx.AsyncClient, p: str) -> str:
        text = ""
        async with client.stream("POST", "/chat/completions", json=body(p)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        text += chunk["choices"][0]["delta"].get("content", "")
        return text

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    concurrent = asyncio.run(run_all())
    sequential = [post(server, {**body(p), "stream": False}).json()["choices"][0]["message"]["content"]
                  for p in prompts]
    return concurrent, sequential


def test_sixteen_concurrent_greedy_streams_equal_sequential_runs(tiny_server):
    concurrent, sequential = _concurrent_and_sequential(tiny_server)
    assert concurrent == sequential


def test_quantized_concurrent_greedy_streams_equal_sequential_runs(quantized_server):
    # concurrent streams mix prompt chunks (layer-by-layer path) with decode-only steps (the stack)
    concurrent, sequential = _concurrent_and_sequential(quantized_server)
    assert concurrent == sequential
    assert len(set(concurrent)) > 1


def test_client_disconnect_mid_stream_frees_the_request(tiny_server):
    body = {"messages": MSG, "max_tokens": 2000, "temperature": 1.0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.base_url + "/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    # The server keeps serving after the disconnect.
    r = post(tiny_server, {"messages": MSG, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200


def test_kiln_chat_cli_prints_the_streamed_reply(tiny_server):
    import subprocess
    import sys

    direct = post(tiny_server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                "temperature": 0}).json()["choices"][0]["message"]["content"]
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "chat", "--url", tiny_server.url, "-m", "hi",
                          "--max-tokens", "8", "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == direct + "\n"
