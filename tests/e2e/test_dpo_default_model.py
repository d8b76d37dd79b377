"""DPO on the embedded default model (SmolLM2-135M-Instruct) through a real `kiln serve`: a judgment set
preferring "Answer: X." to "X." trains an adapter that ranks the preferred reply higher on held-out
prompts, where the base did so only sometimes. Prints the figures and the job's wall time."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FACTS = [  # (question, answer): 40 prompts
    ("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"), ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Germany?", "Berlin"), ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Canada?", "Ottawa"), ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of China?", "Beijing"), ("What is the capital of Greece?", "Athens"),
    ("What is the capital of Portugal?", "Lisbon"), ("What is the capital of Austria?", "Vienna"),
    ("What is the capital of Norway?", "Oslo"), ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of Peru?", "Lima"), ("What is the capital of Ireland?", "Dublin"),
    ("What is 2 + 2?", "4"), ("What is 3 + 5?", "8"), ("What is 10 - 4?", "6"), ("What is 6 times 7?", "42"),
    ("What is 9 + 1?", "10"), ("What is 12 divided by 3?", "4"), ("What is 5 squared?", "25"), ("What is 100 - 1?", "99"),
    ("What color is the sky on a clear day?", "Blue"), ("What color is grass?", "Green"), ("What color is snow?", "White"),
    ("What color is a ripe banana?", "Yellow"), ("How many legs does a spider have?", "Eight"),
    ("How many days are in a week?", "Seven"), ("How many continents are there?", "Seven"),
    ("What is the largest planet in our solar system?", "Jupiter"), ("What gas do plants take in?", "Carbon dioxide"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare"), ("What is the freezing point of water in Celsius?", "0 degrees"),
    ("What is the chemical symbol for gold?", "Au"), ("What is the opposite of hot?", "Cold"),
    ("Which animal is known as the king of the jungle?", "The lion"), ("What language is spoken in Brazil?", "Portuguese"),
    ("How many hours are in a day?", "24")]


def test_dpo_from_judgments_raises_held_out_preference_accuracy_on_the_default_model(tmp_path):
    server = start_server(None, tmp_path)
    try:
        c = httpx.Client(base_url=server.url, timeout=120)
        assert c.post("/v1/judgments", json={"name": "answer-style"}).status_code == 200
        for i, (q, a) in enumerate(FACTS):
            preferred, plain = f"Answer: {a}.", f"{a}."
            a_first = i % 2 == 0   # the preferred reply on either side
            r = c.post("/v1/judgments/answer-style/rows", json={
                "prompt": [{"role": "user", "content": q}], "response_a": preferred if a_first else plain,
                "response_b": plain if a_first else preferred, "winner": "a" if a_first else "b"})
            assert r.status_code == 200, r.text
        t0 = time.monotonic()
        r = c.post("/v1/train/dpo", json={"judgments": "answer-style", "config": {
            "output_name": "answer-style-dpo", "epochs": 2, "heldout_percent": 25}})
        assert r.status_code == 200, r.text
        job_id = r.json()["job_id"]
        while (status := c.get(f"/v1/train/status/{job_id}").json())["state"] not in ("completed", "failed"):
            assert time.monotonic() - t0 < 900, status
            time.sleep(1)
        wall = time.monotonic() - t0
    finally:
        stop_server(server)
    assert status["state"] == "completed", status
    held = status["held_out"]
    print(f"DPO on SmolLM2: {status['training_data']['train_pairs']} pairs x 2 epochs, {status['step']} steps in "
          f"{wall:.1f} s; held-out ({held['pairs']} pairs) preference accuracy {held['preference_accuracy_before']} "
          f"-> {held['preference_accuracy_after']}, mean log-prob margin {held['mean_logprob_margin_before']} -> "
          f"{held['mean_logprob_margin_after']}")
    assert held["pairs"] >= 4
    assert held["mean_logprob_margin_after"] > held["mean_logprob_margin_before"] + 1.0
    assert held["preference_accuracy_after"] >= 0.9 and held["win_rate_vs_start"] >= 0.9
