"""Reasoning split and thinking budgets end to end, on a tiny Qwen3-style model that prompts inside <think>."""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

INF = "kiln-inference-v1.schema.json"
pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Think about the sea, then answer."}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("q3") / "tiny-qwen3", arch="qwen3", init_std=0.3,
                            thinking_prompt=True)
    server = start_server(str(model), tmp_path_factory.mktemp("q3srv"), "--served-model-id", "tiny-qwen3")
    yield server
    stop_server(server)


def chat(server, **body) -> dict:
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": MSG, **body}, timeout=120)
    assert r.status_code == 200, r.text
    validate(INF, "ChatCompletionResponse", r.json())
    return r.json()


def test_prompt_inside_think_reports_reasoning_mode(thinking_server):
    body = chat(thinking_server, max_tokens=8, temperature=0)
    meta = body["metadata"]
    assert meta["thinking_enabled"] is True and meta["thinking_mode"] == "reasoning"
    assert meta["thinking_budget"]["configured"] is False
    # no close tag within 8 tokens: everything is reasoning and the answer is empty
    msg = body["choices"][0]["message"]
    assert msg["content"] == "" and msg.get("reasoning_content")
    assert meta["final_content_empty"] is True
    assert meta["content_empty_reason"] == "reasoning_without_final_content"


def test_token_budget_forces_the_close_and_content_follows(thinking_server):
    body = chat(thinking_server, max_tokens=20, temperature=0, thinking_budget_tokens=3)
    choice = body["choices"][0]
    outcome = choice["thinking_budget"]
    assert outcome["triggered"] is True and outcome["trigger"] == "tokens"
    assert outcome["closed"] is True and outcome["thinking_tokens"] == 3
    record = body["metadata"]["thinking_budget"]
    assert record["applied"] is True and record["tokens_source"] == "request"
    assert choice["message"]["reasoning_content"]
    assert "</think>" not in choice["message"]["content"]


def test_stop_overlapping_close_sequence_is_rejected_when_budget_applies(thinking_server):
    r = httpx.post(thinking_server.base_url + "/chat/completions", timeout=60,
                   json={"messages": MSG, "thinking_budget_tokens": 4, "stop": ["</th"]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stop"


def test_streaming_matches_non_streaming_reasoning_and_content(thinking_server):
    req = {"messages": MSG, "max_tokens": 16, "temperature": 0.8, "seed": 5, "thinking_budget_tokens": 4}
    plain = chat(thinking_server, **{k: v for k, v in req.items() if k != "messages"})
    reasoning, content = "", ""
    terminal = None
    with httpx.stream("POST", thinking_server.base_url + "/chat/completions", json={**req, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            validate(INF, "ChatCompletionChunk", chunk)
            delta = chunk["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            if "finish_reason" in chunk["choices"][0]:
                terminal = chunk
    msg = plain["choices"][0]["message"]
    assert reasoning == msg.get("reasoning_content", "")
    assert content == msg["content"]
    assert terminal["metadata"]["thinking_budget"]["applied"] is True
