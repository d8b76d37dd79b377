"""Self-distillation for conciseness on the embedded default model (SmolLM2-135M-Instruct) through a real
`kiln serve`: the teacher is the model told to be brief (which halves its answers), the student learns to
answer without being told. On held-out prompts the adapter's greedy answers, generated with room to spare
(max_tokens well above their length), are shorter than the base model's. Prints the figures and the job's
wall time."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAIN = ["What is photosynthesis?", "What is a computer?", "How do birds fly?", "What is gravity?",
         "What is the internet?", "What is a volcano?"]
EPOCHS = 4
HELD_OUT = ["Why is the sky blue?", "Who was Albert Einstein?", "Why do we sleep?", "What is a planet?",
            "How do plants grow?", "What is music?"]
ROOM = 192   # max_tokens for the measured answers: the base model's longest held-out answer is ~160 tokens


def mean_answer_tokens(c: httpx.Client, model: str | None) -> float:
    lengths = []
    for q in HELD_OUT:
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": ROOM, "temperature": 0}
        r = c.post("/v1/chat/completions", json={**body, **({"model": model} if model else {})})
        assert r.status_code == 200, r.text
        lengths.append(r.json()["usage"]["completion_tokens"])
    return sum(lengths) / len(lengths)


def test_conciseness_self_distillation_shortens_held_out_answers_on_the_default_model(tmp_path):
    server = start_server(None, tmp_path)
    try:
        c = httpx.Client(base_url=server.url, timeout=600)
        before = mean_answer_tokens(c, None)
        t0 = time.monotonic()
        r = c.post("/v1/distill/self", json={"prompts": TRAIN, "mode": "conciseness", "config": {
            "output_name": "concise", "epochs": EPOCHS, "learning_rate": 5e-4, "max_new_tokens": 64,
            "auto_load": False}})
        assert r.status_code == 200, r.text
        job_id = r.json()["job_id"]
        while (status := c.get(f"/v1/train/status/{job_id}").json())["state"] not in ("completed", "failed"):
            assert time.monotonic() - t0 < 1800, status
            time.sleep(2)
        wall = time.monotonic() - t0
        assert status["state"] == "completed", status
        assert c.post("/v1/adapters/load", json={"name": "concise"}).status_code == 200
        after = mean_answer_tokens(c, None)
    finally:
        stop_server(server)
    held = status["held_out"]
    print(f"distill/self conciseness on SmolLM2: {len(TRAIN)} prompts x {EPOCHS} epochs, {status['step']} steps in "
          f"{wall:.1f} s; teacher completions {held['mean_completion_tokens']} tokens on average; KL to the teacher "
          f"{held['kl_to_teacher_before']} -> {held['kl_to_teacher_after']}; held-out mean greedy answer "
          f"{before:.1f} -> {after:.1f} tokens (max_tokens {ROOM})")
    assert held["kl_to_teacher_after"] < held["kl_to_teacher_before"]
    assert after < 0.8 * before, (before, after)
