"""POST /v1/completions/batch on the real server: seeding per (prompt, completion), one continuous
batch for all prompts, and a failing prompt that leaves the others intact."""

from __future__ import annotations

import httpx
import pytest

from kiln.testing.schemas import validate

INF = "kiln-inference-v1.schema.json"
pytestmark = pytest.mark.e2e
PROMPTS = [[{"role": "user", "content": f"Describe the number {i} in a few words."}] for i in range(4)]


def batch(server, body: dict) -> dict:
    validate(INF, "BatchCompletionRequest", body)
    r = httpx.post(server.base_url + "/completions/batch", json=body, timeout=120)
    assert r.status_code == 200, r.text
    validate(INF, "BatchCompletionResponse", r.json())
    return r.json()


def engine_steps(server) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kiln_engine_steps_total "):
            return float(line.split()[-1])
    raise AssertionError("kiln_engine_steps_total missing from /metrics")


def test_completion_p_c_equals_a_chat_request_seeded_seed_plus_p_n_plus_c(tiny_server):
    body = batch(tiny_server, {"prompts": PROMPTS[:2], "n": 3, "max_tokens": 10, "seed": 100, "temperature": 1.0})
    for item in body["completions"]:
        p, c = item["prompt_index"], item["completion_index"]
        chat = httpx.post(tiny_server.base_url + "/chat/completions", timeout=120, json={
            "messages": PROMPTS[p], "max_tokens": 10, "seed": 100 + p * 3 + c, "temperature": 1.0}).json()
        assert item["text"] == chat["choices"][0]["message"]["content"]
        assert item["usage"] == chat["usage"]


def test_all_prompts_run_as_one_continuous_batch(tiny_server):
    before = engine_steps(tiny_server)
    body = batch(tiny_server, {"prompts": PROMPTS, "n": 2, "max_tokens": 6, "ignore_eos": True, "seed": 1})
    steps = engine_steps(tiny_server) - before
    assert body["usage"]["completion_tokens"] == 4 * 2 * 6
    # one after another would take at least 4 prompts x 6 tokens = 24 steps
    assert steps < 24


def test_a_prompt_that_cannot_run_fails_alone(tiny_server):
    prompts = [PROMPTS[0], [{"role": "user", "content": "word " * 3000}], PROMPTS[1]]
    body = batch(tiny_server, {"prompts": prompts, "max_tokens": 4, "seed": 2})
    reasons = [item["finish_reason"] for item in body["completions"]]
    assert reasons[1] == "error" and body["completions"][1]["usage"]["completion_tokens"] == 0
    assert reasons[0] != "error" and reasons[2] != "error"
