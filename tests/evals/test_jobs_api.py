"""Eval job routes over HTTP (semantics.md §1.5) with a scripted generator; every body checked against the contract."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kiln.api.app import create_app
from kiln.config import Settings
from kiln.server import build_state
from kiln.testing.schemas import validate
from tests.evals.test_jobs_fixtures import SCHEMA, FakeGenerator, suite_data

TERMINAL = ("completed", "failed", "cancelled")


def build(tmp_path, **eval_settings):
    settings = Settings()
    settings.data.data_dir = str(tmp_path)
    for key, value in eval_settings.items():
        setattr(settings.eval, key, value)
    state = build_state(settings)
    app = create_app(settings, state)
    return app, state


@pytest.fixture
def served(tmp_path):
    app, state = build(tmp_path)
    gen = FakeGenerator()
    state.services.eval_jobs.generator_factory = lambda: gen
    with TestClient(app) as client:
        assert client.post("/v1/eval/suites", json=suite_data()).status_code == 200
        yield client, gen


def error_of(resp, status, code):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == code and body["hint"]
    return body


def wait_done(client, job_id, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/v1/eval/jobs/{job_id}").json()
        if body["state"] in TERMINAL:
            return body
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish")


def queued(resp):
    assert resp.status_code == 200, resp.text
    body = resp.json()
    validate(SCHEMA, "EvalRunResponse", body)
    return body


def test_run_queues_a_job_that_completes_with_a_valid_result(served):
    client, _ = served
    receipt = queued(client.post("/v1/eval/run", json={"suite": "math", "seed": 7}))
    assert receipt["effective_seed"] == "7" and receipt["message"] == "Queued eval against suite `math`"
    result = wait_done(client, receipt["job_id"])
    validate(SCHEMA, "EvalResult", result)
    assert result["state"] == "completed" and result["runs"][0]["metrics"]["num_examples"] == 3


def test_inline_suites_run_without_registration(served):
    client, _ = served
    receipt = queued(client.post("/v1/eval/run", json={"inline_suite": suite_data("adhoc"), "seed": "3"}))
    assert wait_done(client, receipt["job_id"])["runs"][0]["suite_name"] == "adhoc"


def test_job_list_is_newest_first_and_schema_valid(served):
    client, _ = served
    ids = [queued(client.post("/v1/eval/run", json={"suite": "math"}))["job_id"] for _ in range(2)]
    for job_id in ids:
        wait_done(client, job_id)
    body = client.get("/v1/eval/jobs").json()
    validate(SCHEMA, "EvalJobListResponse", body)
    assert [j["job_id"] for j in body["jobs"]] == ids[::-1]
    assert body["jobs"][0]["headline_accuracy"] == pytest.approx(2 / 3)


def test_run_needs_exactly_one_suite(served):
    client, _ = served
    body = error_of(client.post("/v1/eval/run", json={"suite": "math", "inline_suite": suite_data()}), 400,
                    "eval_invalid_request")
    assert body["message"].startswith("Invalid eval request: ")
    error_of(client.post("/v1/eval/run", json={}), 400, "eval_invalid_request")


def test_run_of_an_unknown_suite_is_404(served):
    client, _ = served
    error_of(client.post("/v1/eval/run", json={"suite": "nope"}), 404, "eval_suite_not_found")


def test_run_with_an_unknown_adapter_is_404(served):
    client, _ = served
    body = error_of(client.post("/v1/eval/run", json={"suite": "math", "adapter": "ghost"}), 404,
                    "adapter_not_found")
    assert body["param"] == "adapter"


def test_bad_generation_override_names_the_field(served):
    client, _ = served
    body = error_of(client.post("/v1/eval/run", json={"suite": "math", "generation": {"top_k": -1}}), 400,
                    "eval_invalid_request")
    assert body["param"] == "generation.top_k"


def test_compare_runs_one_suite_result_per_adapter(served):
    client, _ = served
    receipt = queued(client.post("/v1/eval/compare", json={"suite": "math", "adapters": ["", ""], "seed": 1}))
    assert receipt["message"] == "Queued compare-mode eval against suite `math`"
    result = wait_done(client, receipt["job_id"])
    assert [r["adapter"] for r in result["runs"]] == [None, None]
    info = client.get("/v1/eval/jobs").json()["jobs"][0]
    assert info["submission_kind"] == "compare"


def test_compare_takes_one_to_eight_adapters(served):
    client, _ = served
    error_of(client.post("/v1/eval/compare", json={"suite": "math", "adapters": []}), 400, "eval_invalid_request")
    error_of(client.post("/v1/eval/compare", json={"suite": "math", "adapters": [""] * 9}), 400,
             "eval_invalid_request")


def test_delete_cancels_queued_then_deletes_terminal_jobs(served):
    client, gen = served
    gen.hold = {"2 + 2?"}
    running = queued(client.post("/v1/eval/run", json={"suite": "math"}))["job_id"]
    waiting = queued(client.post("/v1/eval/run", json={"suite": "math"}))["job_id"]
    cancelled = client.delete(f"/v1/eval/jobs/{waiting}").json()
    validate(SCHEMA, "CancelEvalJobResponse", cancelled)
    assert cancelled["status"] == "cancelled"
    stopping = client.delete(f"/v1/eval/jobs/{running}").json()
    validate(SCHEMA, "CancelEvalJobResponse", stopping)
    assert stopping["status"] == "cancelling"
    deleted = client.delete(f"/v1/eval/jobs/{waiting}").json()
    validate(SCHEMA, "CancelEvalJobResponse", deleted)
    assert deleted == {"status": "deleted", "job_id": waiting, "removed_archive_file": True}
    error_of(client.get(f"/v1/eval/jobs/{waiting}"), 404, "eval_job_not_found")


def test_unknown_jobs_are_404(served):
    client, _ = served
    error_of(client.get("/v1/eval/jobs/eval-missing"), 404, "eval_job_not_found")
    error_of(client.delete("/v1/eval/jobs/eval-missing"), 404, "eval_job_not_found")
    error_of(client.post("/v1/eval/jobs/eval-missing/rerun", json={}), 404, "eval_job_not_found")


def test_rerun_and_replay_answer_run_receipts(served):
    client, _ = served
    source = queued(client.post("/v1/eval/run", json={"suite": "math", "seed": 5}))["job_id"]
    wait_done(client, source)
    rerun = queued(client.post(f"/v1/eval/jobs/{source}/rerun"))
    assert rerun["message"] == "Queued re-run of 1 example(s) from `math`"
    replay = queued(client.post(f"/v1/eval/jobs/{source}/replay", json={"run_index": 0}))
    assert replay["message"] == f"Queued strict replay of source job `{source}` run 0"
    result = wait_done(client, replay["job_id"])
    validate(SCHEMA, "EvalResult", result)
    assert result["replay_verdict"]["status"] == "matched"


def test_a_full_queue_is_503_with_retry_after(tmp_path):
    app, state = build(tmp_path, max_queued_jobs=1)
    gen = FakeGenerator()
    gen.hold = {"2 + 2?"}
    state.services.eval_jobs.generator_factory = lambda: gen
    with TestClient(app) as client:
        client.post("/v1/eval/run", json={"inline_suite": suite_data()})  # picked up by the worker
        deadline = time.monotonic() + 5
        while not gen.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        client.post("/v1/eval/run", json={"inline_suite": suite_data()})  # waits in the queue
        resp = client.post("/v1/eval/run", json={"inline_suite": suite_data()})
        error_of(resp, 503, "eval_queue_full")
        assert resp.headers["retry-after"] == "15"


def test_runs_are_refused_while_the_model_loads(tmp_path):
    app, _ = build(tmp_path)
    with TestClient(app) as client:
        error_of(client.post("/v1/eval/run", json={"inline_suite": suite_data()}), 503, "model_loading")


def test_archived_jobs_survive_an_app_restart(tmp_path):
    app, state = build(tmp_path)
    state.services.eval_jobs.generator_factory = FakeGenerator
    with TestClient(app) as client:
        job_id = queued(client.post("/v1/eval/run", json={"inline_suite": suite_data()}))["job_id"]
        before = wait_done(client, job_id)
    app, _ = build(tmp_path)
    with TestClient(app) as client:
        assert client.get(f"/v1/eval/jobs/{job_id}").json() == before
