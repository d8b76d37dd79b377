"""POST /v1/train/sft with post_eval on a real tiny model, in process (semantics.md §8.14): the training
job links a post-training eval job, the gate decides on real generations, and the training status shows
the outcome and its evidence. Suites whose scorer ignores the model's words force the outcome."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kiln.api.app import create_app
from kiln.config import DataSettings, EngineSettings, ModelSettings, Settings
from kiln.server import build_state
from kiln.testing.schemas import validate

EVALS = "kiln-evals-v1.schema.json"
ERROR_KEYS = {"message", "type", "param", "code", "hint"}
TRAIN = [{"messages": [{"role": "user", "content": "What is the capital of Zorbania?"},
                       {"role": "assistant", "content": "Quillton."}]}]
NEVER = "\u00a7kiln-never-says-this\u00a7"


def suite(name: str, n: int, scorer: dict, prompt: str = "Tell me about item {i}.") -> dict:
    return {"name": name, "default_scorer": scorer, "schema_version": 2,
            "generation": {"temperature": 0, "max_tokens": 2},
            "examples": [{"id": f"item-{i:02d}", "messages": [{"role": "user", "content": prompt.format(i=i)}],
                          "target": "x"} for i in range(n)]}


@contextmanager
def tiny_server(root: Path, suites: list[dict]) -> Iterator[TestClient]:
    """The whole app on a tiny llama (float32, adapters attached) in process, with `suites` stored."""
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    settings = Settings(model=ModelSettings(path=str(make_tiny_model(root / "tiny", arch="llama", init_std=0.3)),
                                            dtype="float32", served_model_id="tiny"),
                        data=DataSettings(data_dir=str(root / "data")),
                        engine=EngineSettings(kv_cache_memory_mb=8, max_model_len=320))
    state = build_state(settings)
    app = create_app(settings, state)
    engine = build_engine(settings)
    engine.attach_adapters(state.services.adapter_store, state.services.adapter_compose_cache,
                           state.services.adapters_active)
    state.engine = engine
    with TestClient(app) as c:
        for body in suites:
            assert c.post("/v1/eval/suites", json=body).status_code == 200
        yield c
    engine.shutdown()


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("post-eval-api"), [
            suite("always", 20, {"kind": "contains", "phrases": [NEVER], "mode": "none"}),
            suite("real", 4, {"kind": "exact_match"}),
            suite("leaky", 2, {"kind": "exact_match"}, prompt="what is the capital of  ZORBANIA?")]) as c:
        yield c


def train(client, post_eval: dict, name: str) -> dict:
    r = client.post("/v1/train/sft", json={"examples": TRAIN, "post_eval": post_eval, "config": {
        "output_name": name, "epochs": 1, "lora_rank": 2, "lora_alpha": 4}})
    assert r.status_code == 200, r.text
    return r.json()


def settled(client, job_id: str, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/train/status/{job_id}").json()
        if status["state"] in ("failed", "cancelled") or (
                status["state"] == "completed" and status.get("gate_outcome") not in (None, "pending")):
            return status
        time.sleep(0.1)
    raise AssertionError(f"training job {job_id} did not settle: {status}")


def linked_eval(client, status: dict) -> dict:
    (eval_id,) = status["linked_eval_job_ids"]
    listing = client.get("/v1/eval/jobs").json()
    validate(EVALS, "EvalJobListResponse", listing)
    (info,) = [j for j in listing["jobs"] if j["job_id"] == eval_id]
    validate(EVALS, "EvalResult", client.get(f"/v1/eval/jobs/{eval_id}").json())
    return info


def assert_error(resp, status: int, code: str, param: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS and (err["code"], err["param"]) == (code, param) and err["hint"]
    return err


def test_a_gate_that_passes_on_real_generations_promotes_the_adapter(client):
    job = train(client, {"suite": "always", "min_accuracy": 0.5, "relative_recovery": 0.8}, "gated-pass")
    status = settled(client, job["job_id"])
    assert status["state"] == "completed" and status["gate_outcome"] == "promoted", status
    ev = status["post_eval_gate_evidence"]
    assert (ev["num_paired"], ev["candidate_passes"], ev["baseline_passes"]) == (20, 20, 20)
    assert ev["relative_recovery_lower_bound"] == pytest.approx(0.83887, abs=1e-5)
    assert ev["policy"] == "paired_wilson_v1" and ev["baseline_adapter"] is None
    assert status["post_eval_verdict"].startswith("promoted")
    info = linked_eval(client, status)
    assert info["submission_kind"] == "post_training" and info["source_training_job_id"] == job["job_id"]
    assert info["adapters"] == [None, "gated-pass"] and info["state"] == "completed"
    assert info["post_eval_gate"]["adapter_name"] == "gated-pass"
    assert client.get("/v1/adapters").json()["active"] == "gated-pass"
    detail = client.get(f"/v1/train/jobs/{job['job_id']}").json()
    assert detail["post_eval"]["suite"] == "always" and detail["activated"] is True


def test_few_real_pairs_leave_the_adapter_on_disk_inactive(client):
    before = client.get("/v1/adapters").json()["active"]
    job = train(client, {"suite": "real", "min_accuracy": 0.0}, "gated-small")
    status = settled(client, job["job_id"])
    assert status["gate_outcome"] == "inconclusive" and "at least 20" in status["post_eval_verdict"]
    assert status["post_eval_gate_evidence"]["num_paired"] == 4
    assert status["post_eval_gate_evidence"]["baseline_adapter"] == before  # the adapter active before training
    adapters = client.get("/v1/adapters").json()
    assert adapters["active"] == before and "gated-small" in [a["name"] for a in adapters["available"]]
    assert linked_eval(client, status)["adapters"] == [before, "gated-small"]


def test_an_overlapping_held_out_suite_is_refused_before_queuing(client):
    queued_before = len(client.get("/v1/train/status").json())
    err = assert_error(client.post("/v1/train/sft", json={"examples": TRAIN, "post_eval": {"suite": "leaky"}}),
                       400, "training_invalid_request", "post_eval.suite")
    assert "overlaps the training data" in err["message"]
    assert len(client.get("/v1/train/status").json()) == queued_before


def test_post_eval_request_errors_are_400s_or_404s_naming_the_field(client):
    assert_error(client.post("/v1/train/sft", json={"examples": TRAIN, "post_eval": {"suite": "missing"}}),
                 404, "eval_suite_not_found", "post_eval.suite")
    assert_error(client.post("/v1/train/sft", json={"examples": TRAIN, "post_eval": {
        "suite": "real", "data_scope": "train-set-eval", "min_accuracy": 0.5}}),
        400, "training_invalid_request", "post_eval.min_accuracy")
    assert_error(client.post("/v1/train/sft", json={"examples": TRAIN, "post_eval": {
        "suite": "real", "min_accuracy": 2}}), 400, "training_invalid_request", "post_eval.min_accuracy")
