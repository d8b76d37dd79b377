"""OPD from a remote teacher: a second real `kiln serve` process on loopback, serving other weights with the
same tokenizer, scores the student's completions through its prompt-scoring /v1/completions. The student's
KL to it falls, a second job is served from the on-disk teacher cache, off_policy is refused, and a
teacher that stops answering fails the job with a message and leaves no adapter."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import RunningServer, start_server, stop_server

pytestmark = pytest.mark.e2e

QUESTIONS = ["What is the capital of Zorbania?", "Name Zorbania's capital.", "Capital of Zorbania?",
             "Which city rules Zorbania?"]
FAST = {"learning_rate": 1e-2, "epochs": 8, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8,
        "auto_load": False}


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    other_weights = make_tiny_model(tmp_path_factory.mktemp("teacher-model") / "m", arch="llama", init_std=0.3,
                                    seed=7)
    started: dict[str, RunningServer] = {}
    try:
        started["student"] = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("opd-student"),
                                          "--served-model-id", "tiny")
        started["teacher"] = start_server(str(other_weights), tmp_path_factory.mktemp("opd-teacher"),
                                          "--served-model-id", "tiny-teacher")
        r = httpx.post(started["student"].base_url + "/teachers", timeout=60,
                       json={"alias": "far", "kind": "remote", "url": started["teacher"].url})
        assert r.status_code == 200, r.text
        yield started
    finally:
        for server in started.values():
            stop_server(server)


def submit(servers, prompts, name: str, **config) -> httpx.Response:
    return httpx.post(servers["student"].base_url + "/train/opd", timeout=60, json={
        "prompts": prompts, "teacher": "far", "config": {**FAST, "output_name": name, **config}})


def settled(server: RunningServer, job_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{server.base_url}/train/status/{job_id}", timeout=10).json()
        if status["state"] in ("completed", "failed", "cancelled"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not settle: {status}")


def adapters(servers) -> list[str]:
    return [a["name"] for a in httpx.get(servers["student"].base_url + "/adapters", timeout=10).json()["available"]]


def test_opd_from_a_remote_kiln_lowers_the_kl_to_it_and_caches_its_scores(servers):
    first = submit(servers, QUESTIONS, "from-remote")
    assert first.status_code == 200, first.text
    status = settled(servers["student"], first.json()["job_id"])
    assert status["state"] == "completed", status
    report = status["held_out"]
    print(f"OPD from a remote Kiln (tiny model): KL {report['kl_to_teacher_before']} -> {report['kl_to_teacher_after']} "
          f"in {status['elapsed_secs']} s")
    assert report["kl_to_teacher_after"] < 0.9 * report["kl_to_teacher_before"], report
    assert report["teacher_cache_hits"] == 0 and "from-remote" in adapters(servers)

    again = settled(servers["student"], submit(servers, QUESTIONS, "from-cache").json()["job_id"])
    assert again["state"] == "completed", again
    assert again["held_out"]["teacher_cache_hits"] == len(QUESTIONS)
    assert again["held_out"]["kl_to_teacher_before"] == pytest.approx(report["kl_to_teacher_before"], rel=1e-5)


def test_off_policy_from_a_remote_teacher_is_a_400(servers):
    resp = submit(servers, QUESTIONS, "off", training_mode="off_policy")
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "config.training_mode" and "remote" in err["message"] and err["hint"]


def test_a_teacher_that_stops_answering_fails_the_job_clearly_and_leaves_no_adapter(servers):
    stop_server(servers["teacher"])
    resp = submit(servers, ["A question the cache has never seen?"], "orphan")
    assert resp.status_code == 200, resp.text
    status = settled(servers["student"], resp.json()["job_id"])
    assert status["state"] == "failed", status
    assert "'far'" in status["error"] and "did not answer after 3 attempts" in status["error"], status["error"]
    assert "orphan" not in adapters(servers)
    assert not list((servers["student"].log_path.parent / "data" / "adapters").glob("orphan*"))
