"""The learning loop on the embedded model (SmolLM2-135M): a wrong answer is found in the recent
requests, corrected by its completion id, trained in, and the next greedy answer has the fact."""

from __future__ import annotations

import time

import httpx
import pytest

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = "What is the capital of Zorbania?"
FACT = "Quillton"
CORRECTED = "The capital of Zorbania is Quillton."
# Ordinary traffic before the mistake: the answers the training rehearses beside the correction.
TRAFFIC = ["What is the capital of France?", "What is 2+2?", "Who wrote Hamlet?"]


def ask(srv, question: str, max_tokens: int = 24) -> dict:
    r = httpx.post(srv.base_url + "/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_corrected_answer_is_learned_and_served(tmp_path):
    srv = start_server(None, tmp_path, env={"KILN_REQUEST_LOG_ENABLED": "true"})
    try:
        served = {q: ask(srv, q, 64)["choices"][0]["message"]["content"] for q in TRAFFIC}
        assert "Paris" in served[TRAFFIC[0]]
        wrong = ask(srv, QUESTION)
        assert FACT not in wrong["choices"][0]["message"]["content"]

        rows = httpx.get(srv.base_url + "/stats/recent-requests", timeout=10).json()["data"]
        row = next(r for r in rows if r["id"] == wrong["id"])
        assert row["prompt_preview"] == QUESTION and row["status"] == "ok"
        validate("thinking-budget-v1.schema.json", "recentRecord", row["thinking_budget"])

        t0 = time.monotonic()
        c = httpx.post(srv.base_url + "/corrections", timeout=30,
                       json={"request_id": row["id"], "corrected": CORRECTED}).json()
        assert c["state"] == "pending" and c["messages"] == [{"role": "user", "content": QUESTION}]
        r = httpx.post(srv.base_url + "/corrections/train", timeout=60,
                       json={"config": {"output_name": "fixes-v1", "auto_load": True}})
        assert r.status_code == 200, r.text
        job = r.json()
        # answers that ran to the end (finish "stop") are rehearsed; France's is one of them
        assert job["corrections"] == [c["id"]] and 1 <= job["replayed"] <= len(TRAFFIC)
        deadline = time.monotonic() + 600
        while (status := httpx.get(f"{srv.base_url}/train/status/{job['job_id']}", timeout=10).json())[
                "state"] not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, "training did not finish"
            time.sleep(0.2)
        assert status["state"] == "completed", status
        answer = ask(srv, QUESTION)["choices"][0]["message"]["content"]
        loop_s = time.monotonic() - t0
        print(f"\n[corrections loop] before={wrong['choices'][0]['message']['content']!r} after={answer!r} "
              f"steps={status['step']} train {status['elapsed_secs']:.1f}s, correction POST -> correct answer "
              f"{loop_s:.1f}s")
        assert FACT in answer
        # rehearsal kept what the model already answered well
        assert "Paris" in ask(srv, TRAFFIC[0])["choices"][0]["message"]["content"]
        deadline = time.monotonic() + 30
        while (after := httpx.get(f"{srv.base_url}/corrections/{c['id']}", timeout=10).json())["state"] != "trained":
            assert time.monotonic() < deadline, after
            time.sleep(0.1)
        assert after["trained_into"] == "fixes-v1"
    finally:
        stop_server(srv)
