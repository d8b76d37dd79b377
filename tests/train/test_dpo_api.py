"""DPO over HTTP through the whole app on a real tiny model, in process: judgments in, preference JSONL out,
a DPO job from the judgment set with its per-step reward margins and held-out result, the post-training
gate as SFT jobs have it, and bad requests answered 400 in the error envelope with no adapter made."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.train.test_post_eval_api import NEVER, suite, tiny_server

ERROR_KEYS = {"message", "type", "param", "code", "hint"}
QUESTIONS = ["What is the capital of Zorbania?", "Name Zorbania's capital.", "Capital of Zorbania?",
             "Which city rules Zorbania?", "Where is Zorbania's government?", "Tell me Zorbania's capital city.",
             "Zorbania's capital is?", "I need the capital of Zorbania.", "Quick: capital of Zorbania?",
             "What city is the capital of Zorbania?"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("dpo-api"),
                     [suite("always", 20, {"kind": "contains", "phrases": [NEVER], "mode": "none"})]) as c:
        assert c.post("/v1/judgments", json={"name": "prefs"}).status_code == 200
        for i, q in enumerate(QUESTIONS):
            winner = "b" if i % 2 else "a"
            a, b = ("Quillton.", "Paris.") if winner == "a" else ("Paris.", "Quillton.")
            row = {"prompt": [{"role": "user", "content": q}], "response_a": a, "response_b": b, "winner": winner}
            assert c.post("/v1/judgments/prefs/rows", json=row).status_code == 200
        for winner in ("tie", "skip"):
            row = {"prompt": [{"role": "user", "content": "Hi"}], "response_a": "Hello", "response_b": "Hey",
                   "winner": winner}
            assert c.post("/v1/judgments/prefs/rows", json=row).status_code == 200
        yield c


def settled(client, job_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/train/status/{job_id}").json()
        if status["state"] in ("failed", "cancelled") or (
                status["state"] == "completed" and status.get("gate_outcome") != "pending"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"training job {job_id} did not settle: {status}")


def assert_error(resp, param: str) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] == param and err["hint"]
    return err


def test_export_gives_trl_and_openai_preference_jsonl(client):
    r = client.get("/v1/judgments/prefs/export", params={"format": "trl"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/jsonl")
    assert (r.headers["x-kiln-pairs"], r.headers["x-kiln-ties-left-out"], r.headers["x-kiln-skips-left-out"]) == \
        ("10", "1", "1")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert len(rows) == 10 and all(row["chosen"] == [{"role": "assistant", "content": "Quillton."}] for row in rows)
    assert rows[1]["prompt"] == [{"role": "user", "content": QUESTIONS[1]}]
    openai = [json.loads(line) for line in client.get("/v1/judgments/prefs/export?format=openai").text.splitlines()]
    assert openai[0]["preferred_output"] == [{"role": "assistant", "content": "Quillton."}]
    assert openai[0]["non_preferred_output"] == [{"role": "assistant", "content": "Paris."}]
    assert openai[0]["input"]["messages"] == [{"role": "user", "content": QUESTIONS[0]}]
    assert_error(client.get("/v1/judgments/prefs/export?format=csv"), "format")


def test_a_dpo_job_from_a_judgment_set_reports_margins_and_a_held_out_result(client):
    r = client.post("/v1/train/dpo", json={"judgments": "prefs", "config": {
        "output_name": "prefer", "epochs": 2, "learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8,
        "heldout_percent": 30}})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "queued" and "DPO" in r.json()["message"]
    status = settled(client, r.json()["job_id"])
    assert status["state"] == "completed" and status["job_type"] == "dpo", status
    data = status["training_data"]
    assert (data["source"], data["judgments"], data["ties_left_out"], data["skips_left_out"]) == \
        ("judgments", "prefs", 1, 1)
    assert data["train_pairs"] + data["heldout_pairs"] == 10 and data["heldout_pairs"] >= 1
    assert {"reward_margin", "preference_accuracy", "chosen_reward", "rejected_reward"} <= set(status["metrics"])
    detail = client.get(f"/v1/train/jobs/{status['job_id']}").json()
    curve = detail["loss_curve"]
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and curve[-1]["loss"] < curve[0]["loss"]
    assert curve[-1]["reward_margin"] > 0
    held = status["held_out"]
    assert held["pairs"] == data["heldout_pairs"] and held["win_rate_vs_start"] == 1.0
    assert held["mean_logprob_margin_after"] > held["mean_logprob_margin_before"]
    assert detail["train_receipt"]["held_out"] == held
    assert client.get("/v1/adapters").json()["active"] == "prefer"


def test_a_dpo_job_passes_through_the_post_training_gate(client):
    r = client.post("/v1/train/dpo", json={
        "pairs": [{"messages": [{"role": "user", "content": q}], "chosen": "Quillton.", "rejected": "Paris."}
                  for q in QUESTIONS[:3]],
        "post_eval": {"suite": "always", "min_accuracy": 0.5, "relative_recovery": 0.8},
        "config": {"output_name": "gated-dpo", "epochs": 1, "lora_rank": 2, "lora_alpha": 4}})
    assert r.status_code == 200, r.text
    status = settled(client, r.json()["job_id"])
    while status.get("gate_outcome") is None and status["state"] == "completed":  # the gate not yet pending
        status = settled(client, r.json()["job_id"])
    assert status["state"] == "completed" and status["gate_outcome"] == "promoted", status.get("post_eval_verdict")
    assert client.get("/v1/adapters").json()["active"] == "gated-dpo"


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"pairs": []}, "pairs", "must not be empty"),
    ({"pairs": [{"messages": [{"role": "user", "content": "Hi"}], "chosen": "Hello", "rejected": "Hello"}]},
     "pairs[0].chosen", "identical"),
    ({"judgments": "missing"}, "judgments", "not found"),
    ({"pairs": [], "config": {"loss_type": "hinge"}}, "config.loss_type", "sigmoid"),
])
def test_bad_dpo_requests_are_400s_and_make_no_adapter(client, body, param, says):
    jobs_before = len(client.get("/v1/train/status").json())
    err = assert_error(client.post("/v1/train/dpo", json={**body, "config": {"output_name": "bad",
                                                                             **body.get("config", {})}}), param)
    assert says in err["message"]
    assert len(client.get("/v1/train/status").json()) == jobs_before
    assert "bad" not in [a["name"] for a in client.get("/v1/adapters").json()["available"]]


def test_a_judgment_set_with_only_ties_and_skips_is_a_400(client):
    assert client.post("/v1/judgments", json={"name": "undecided"}).status_code == 200
    row = {"prompt": [{"role": "user", "content": "Hi"}], "response_a": "Hello", "response_b": "Hey", "winner": "tie"}
    assert client.post("/v1/judgments/undecided/rows", json=row).status_code == 200
    err = assert_error(client.post("/v1/train/dpo", json={"judgments": "undecided"}), "judgments")
    assert "no A/B judgments" in err["message"]
