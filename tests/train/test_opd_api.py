"""OPD and self-distillation over HTTP through the whole app on a real tiny model, in process: a local
teacher wearing an SFT-trained adapter is registered, an OPD job reports its loss and KL to the teacher
per step and its before/after KL, a self-distillation job runs, and bad requests are 400s in the error
envelope that make no adapter."""

from __future__ import annotations

import pytest

from tests.train.test_dpo_api import ERROR_KEYS, settled
from tests.train.test_post_eval_api import tiny_server

QUESTIONS = ["What is the capital of Zorbania?", "Name Zorbania's capital.", "Capital of Zorbania?",
             "Which city rules Zorbania?"]
FAST = {"learning_rate": 1e-2, "epochs": 4, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("opd-api"), []) as c:
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Quillton."}]}
                for q in QUESTIONS]
        job = c.post("/v1/train/sft", json={"examples": rows, "config": {
            "learning_rate": 1e-2, "epochs": 4, "lora_rank": 4, "lora_alpha": 8, "output_name": "fact",
            "auto_load": False}}).json()
        assert settled(c, job["job_id"])["state"] == "completed"
        resp = c.post("/v1/teachers", json={"alias": "fact-teacher", "kind": "local", "adapter": "fact"})
        assert resp.status_code == 200, resp.text
        yield c


def test_an_opd_job_reports_its_kl_to_the_teacher_per_step_and_lowers_it(client):
    resp = client.post("/v1/train/opd", json={"prompts": QUESTIONS, "teacher": "fact-teacher", "config": {
        **FAST, "training_mode": "off_policy", "output_name": "student", "auto_load": False}})
    assert resp.status_code == 200, resp.text
    status = settled(client, resp.json()["job_id"])
    assert status["state"] == "completed", status
    detail = client.get(f"/v1/train/jobs/{status['job_id']}").json()
    curve = detail["loss_curve"]
    assert all("kl_to_teacher" in p and "loss" in p for p in curve)
    report = status["held_out"]
    assert report["kl_to_teacher_after"] < report["kl_to_teacher_before"], report
    assert detail["config"]["objective"] == status["training_data"]["objective"] == report["objective"] == "forward_kl"
    assert report["forward_kl_after"] < report["forward_kl_before"] and all("forward_kl" in p for p in curve), report
    assert "student" in [a["name"] for a in client.get("/v1/adapters").json()["available"]]


def test_a_self_distillation_job_runs_and_lowers_its_kl(client):
    resp = client.post("/v1/distill/self", json={"prompts": QUESTIONS, "mode": "conciseness", "config": {
        **FAST, "output_name": "concise", "auto_load": False}})
    assert resp.status_code == 200, resp.text
    status = settled(client, resp.json()["job_id"])
    assert status["state"] == "completed", status
    assert status["held_out"]["kl_to_teacher_after"] < status["held_out"]["kl_to_teacher_before"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/train/opd", {"prompts": ["hi"], "teacher": "nobody", "config": {"output_name": "bad1"}}, "teacher"),
    ("/v1/train/opd", {"prompts": [], "teacher": "fact-teacher", "config": {"output_name": "bad2"}}, "prompts"),
    ("/v1/distill/self", {"prompts": ["hi"], "mode": "ground_truth_conditioning", "config": {"output_name": "bad3"}},
     "prompts[0].reference"),
    ("/v1/train/opd", {"prompts": ["hi"], "teacher": "fact-teacher", "config": {"output_name": "bad4",
                                                                               "objective": "kl"}}, "config.objective"),
])
def test_bad_distillation_requests_are_400s_and_make_no_adapter(client, path, body, param):
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] == param
    assert body["config"]["output_name"] not in [a["name"] for a in client.get("/v1/adapters").json()["available"]]
