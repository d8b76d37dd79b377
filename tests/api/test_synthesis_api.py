"""Suite synthesis routes (semantics.md §1.6, §10), every response checked against the evals contract."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kiln.config import Settings
from kiln.errors import KilnError
from kiln.evals.intake import IntakeContext, base_target_only
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.job_store import EvalJobStore
from kiln.evals.suite import parse_suite
from kiln.evals.synthesis import parse_synthesize_body, synthesize
from kiln.server import build_server
from kiln.testing.schemas import validate
from tests.evals.synthesis.corpus import corpus, numbered

SCHEMA = "kiln-evals-v1.schema.json"
CONVERSATIONS = [row for row in corpus() if isinstance(row, dict)]
# Almost everything in holdout: the split keeps one row in train and leaves validation empty.
MOSTLY_HOLDOUT = {"seed": 0, "train_percent": 1, "validation_percent": 0}


@pytest.fixture
def client(tmp_path):
    settings = Settings()
    settings.data.data_dir = str(tmp_path)
    with TestClient(build_server(settings).app) as c:
        yield c


def services(client):
    return client.app.state.kiln.services


def make_dataset(client, name="chats", rows=CONVERSATIONS, split=MOSTLY_HOLDOUT):
    resp = client.post("/v1/eval/datasets/upload", data={"name": name},
                       files={"file": ("data.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows))})
    assert resp.status_code == 200, resp.text
    assert client.put(f"/v1/eval/datasets/{name}/split", json=split).status_code == 200


def expected(client, name, body, split="holdout", head=None):
    rows = services(client).datasets.read_rows(name, split)
    return synthesize(rows, parse_synthesize_body(body), dataset=name, source_split=split, max_conversations=head)


def error_of(resp, status, code, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and err["hint"]
    if param is not None:
        assert err["param"] == param
    return err


def job_manager(client, tmp_path, adapters=("support-v2",)):
    """A real EvalJobManager that knows `adapters`; with no model its jobs fail, but they are queued first."""
    def resolve(adapter):
        if adapter is None or adapter in adapters:
            return {}
        return base_target_only(adapter)

    def no_model():
        raise KilnError(503, "backend_unavailable", "no model in this test")

    ctx = IntakeContext(suites=services(client).eval_suites, resolve_target=resolve, active_adapter=lambda: None)
    manager = EvalJobManager(EvalJobStore(tmp_path / "jobs"), ctx, no_model)
    services(client).eval_jobs = manager
    return manager


# ---- preview ---------------------------------------------------------------------------------------


def test_preview_returns_a_schema_valid_preview_of_the_holdout_split(client):
    make_dataset(client)
    body = {"suite_name": "chats-eval", "head_n": 50, "sampling": {"seed": 7}}
    resp = client.post("/v1/eval/datasets/chats/preview", json=body)
    assert resp.status_code == 200, resp.text
    preview = resp.json()
    validate(SCHEMA, "SynthesisPreview", preview)
    want = expected(client, "chats", body)
    assert preview["examples"] == want.suite_json()["examples"][:10]
    assert preview["stats"] == want.stats.to_json()
    assert (preview["suite_name"], preview["source_split"], preview["default_scorer_kind"]) == (
        "chats-eval", "holdout", "exact_match")
    assert (preview["aggregation"], preview["completions_per_example"]) == ({"kind": "single"}, 1)
    assert all(ex["metadata"]["kiln_dataset_provenance"]["source_split"] == "holdout" for ex in preview["examples"])


def test_preview_is_not_persisted(client):
    make_dataset(client)
    client.post("/v1/eval/datasets/chats/preview", json={"suite_name": "chats-eval"})
    assert client.get("/v1/eval/suites").json() == {"suites": []}
    error_of(client.get("/v1/eval/suites/chats-eval"), 404, "eval_suite_not_found")


@pytest.mark.parametrize(("head_n", "seen"), [(0, 1), (1, 1), (3, 3)])
def test_preview_reads_the_first_head_n_conversations_at_least_one(client, head_n, seen):
    make_dataset(client)
    resp = client.post("/v1/eval/datasets/chats/preview", json={"suite_name": "s", "head_n": head_n})
    validate(SCHEMA, "SynthesisPreview", resp.json())
    assert resp.json()["stats"]["trajectories_seen"] == seen


def test_preview_shows_at_most_ten_examples_while_stats_count_them_all(client):
    make_dataset(client, rows=numbered(30))
    resp = client.post("/v1/eval/datasets/chats/preview", json={"suite_name": "s", "head_n": 100})
    validate(SCHEMA, "SynthesisPreview", resp.json())
    stats = resp.json()["stats"]
    assert len(resp.json()["examples"]) == 10
    assert stats["sample_kept"] == stats["trajectories_seen"] > 10


def test_preview_reads_the_requested_source_split(client):
    make_dataset(client)
    body = {"suite_name": "s", "source_split": "train", "sampling": {"seed": 1}}
    resp = client.post("/v1/eval/datasets/chats/preview", json=body)
    validate(SCHEMA, "SynthesisPreview", resp.json())
    assert resp.json()["source_split"] == "train"
    assert resp.json()["examples"] == expected(client, "chats", body, "train", head=5).suite_json()["examples"]


def test_preview_reports_the_aggregation_and_k(client):
    make_dataset(client)
    body = {"suite_name": "s", "aggregation": {"kind": "pass_at_k", "k": 3}, "generation": {"temperature": 0.8}}
    resp = client.post("/v1/eval/datasets/chats/preview", json=body)
    validate(SCHEMA, "SynthesisPreview", resp.json())
    assert (resp.json()["aggregation"], resp.json()["completions_per_example"]) == ({"kind": "pass_at_k", "k": 3}, 3)


def test_the_same_seed_gives_the_same_preview(client):
    make_dataset(client)
    body = {"suite_name": "s", "strategy": "every_assistant_turn", "sampling": {"seed": 5, "max_examples": 3}}
    first = client.post("/v1/eval/datasets/chats/preview", json=body).json()
    assert client.post("/v1/eval/datasets/chats/preview", json=body).json() == first


# ---- synthesize ------------------------------------------------------------------------------------


def test_synthesize_saves_the_suite_and_returns_its_summary(client):
    make_dataset(client)
    body = {"suite_name": "chats-eval", "description": "From support chats", "sampling": {"seed": 7}}
    resp = client.post("/v1/eval/datasets/chats/synthesize", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    validate(SCHEMA, "SynthesizeDatasetResponse", out)
    want = expected(client, "chats", body)
    assert out["stats"] == want.stats.to_json()
    assert out["queued_eval_job_ids"] == []
    stored = client.get("/v1/eval/suites/chats-eval").json()
    validate(SCHEMA, "EvalSuite", stored)
    assert stored == want.suite_json()
    assert parse_suite(stored).description.startswith("From support chats\n\nSynthesized from dataset 'chats'")
    assert client.get("/v1/eval/suites").json()["suites"] == [out["suite"]]


def test_synthesize_twice_with_the_same_seed_stores_the_identical_suite(client):
    make_dataset(client)
    body = {"suite_name": "s", "strategy": "every_assistant_turn", "sampling": {"seed": 3, "max_examples": 4}}
    client.post("/v1/eval/datasets/chats/synthesize", json=body)
    first = client.get("/v1/eval/suites/s").json()
    client.post("/v1/eval/datasets/chats/synthesize", json={**body, "force": True})
    assert client.get("/v1/eval/suites/s").json() == first


def test_synthesize_over_an_existing_suite_needs_force(client):
    make_dataset(client)
    body = {"suite_name": "s", "sampling": {"seed": 1}}
    assert client.post("/v1/eval/datasets/chats/synthesize", json=body).status_code == 200
    error_of(client.post("/v1/eval/datasets/chats/synthesize", json=body), 409, "eval_suite_exists")
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={**body, "force": True, "strategy": "tool_call_predict"})
    validate(SCHEMA, "SynthesizeDatasetResponse", resp.json())
    assert resp.json()["suite"]["num_examples"] == 2


def test_run_against_queues_one_on_demand_run_per_adapter(client, tmp_path):
    make_dataset(client)
    manager = job_manager(client, tmp_path)
    resp = client.post("/v1/eval/datasets/chats/synthesize",
                       json={"suite_name": "s", "run_against": ["", "support-v2"], "sampling": {"seed": 1}})
    assert resp.status_code == 200, resp.text
    validate(SCHEMA, "SynthesizeDatasetResponse", resp.json())
    ids = resp.json()["queued_eval_job_ids"]
    assert len(ids) == 2 and len(set(ids)) == 2
    jobs = [manager.get(job_id) for job_id in ids]
    assert [(j.suite.name, j.adapters, j.submission_kind, j.generation_override) for j in jobs] == [
        ("s", [None], "on_demand", None), ("s", ["support-v2"], "on_demand", None)]
    assert jobs[0].suite == parse_suite(client.get("/v1/eval/suites/s").json())


def test_run_against_an_unknown_adapter_is_a_404_and_saves_nothing(client, tmp_path):
    make_dataset(client)
    manager = job_manager(client, tmp_path)
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "s", "run_against": ["nope"]})
    error_of(resp, 404, "adapter_not_found")
    assert client.get("/v1/eval/suites").json() == {"suites": []} and manager.jobs == {}


def test_run_against_without_an_eval_job_manager_is_a_503_and_saves_nothing(client):
    make_dataset(client)
    services(client).eval_jobs = None
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "s", "run_against": [""]})
    error_of(resp, 503, "eval_registry_unavailable", "run_against")
    assert client.get("/v1/eval/suites").json() == {"suites": []}


def test_an_empty_run_against_queues_nothing(client):
    make_dataset(client)
    services(client).eval_jobs = None
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "s", "run_against": []})
    validate(SCHEMA, "SynthesizeDatasetResponse", resp.json())
    assert resp.json()["queued_eval_job_ids"] == []


# ---- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["preview", "synthesize"])
def test_an_unknown_dataset_is_404(client, route):
    error_of(client.post(f"/v1/eval/datasets/nope/{route}", json={"suite_name": "s"}), 404, "dataset_not_found")


@pytest.mark.parametrize("route", ["preview", "synthesize"])
def test_an_empty_source_split_is_a_400_naming_source_split(client, route):
    make_dataset(client)  # MOSTLY_HOLDOUT leaves validation empty
    resp = client.post(f"/v1/eval/datasets/chats/{route}", json={"suite_name": "s", "source_split": "validation"})
    err = error_of(resp, 400, "dataset_invalid", "source_split")
    assert "no rows in its validation partition" in err["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"suite_name": "s", "strategy": "random"}, "strategy"),
    ({"suite_name": "s", "sampling": {"max_examples": -1}}, "sampling.max_examples"),
    ({"suite_name": "s", "scorer": {"kind": "fixed", "scorer": {"kind": "regex"}}}, "scorer.scorer.pattern"),
    ({"suite_name": "s", "aggregation": {"kind": "majority_at_k", "k": 4}}, "aggregation.k"),
    ({"suite_name": "s", "source_split": "test"}, "source_split"),
    ({"suite_name": "s", "force": "yes"}, "force"),
])
def test_a_bad_config_is_a_400_naming_the_field(client, body, param):
    make_dataset(client)
    route = "synthesize" if "force" in body else "preview"
    error_of(client.post(f"/v1/eval/datasets/chats/{route}", json=body), 400, "eval_invalid_request", param)


def test_a_bad_suite_name_is_invalid_suite_name(client):
    make_dataset(client)
    error_of(client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "../x"}), 400,
             "invalid_suite_name", "suite_name")


def test_a_body_that_is_not_json_is_a_400(client):
    resp = client.post("/v1/eval/datasets/chats/preview", content=b"{nope", headers={"content-type": "application/json"})
    error_of(resp, 400, "eval_invalid_request")


def test_a_split_with_nothing_to_synthesize_is_a_400_dataset_invalid(client):
    make_dataset(client, rows=[{"messages": [{"role": "user", "content": f"unanswered {i}"}]} for i in range(5)])
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "s"})
    assert "synthesis produced no examples" in error_of(resp, 400, "dataset_invalid")["message"]
    assert client.get("/v1/eval/suites").json() == {"suites": []}


def test_run_against_the_base_model_uses_the_servers_own_job_manager(client):
    make_dataset(client)
    resp = client.post("/v1/eval/datasets/chats/synthesize", json={"suite_name": "s", "run_against": [""]})
    assert resp.status_code == 200, resp.text
    validate(SCHEMA, "SynthesizeDatasetResponse", resp.json())
    [job_id] = resp.json()["queued_eval_job_ids"]
    job = services(client).eval_jobs.get(job_id)
    assert (job.suite.name, job.adapters, job.submission_kind) == ("s", [None], "on_demand")
