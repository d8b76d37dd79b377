"""Acting on a gate outcome (semantics.md §8.14): promotion, demotion, and every failure failing closed."""

from __future__ import annotations

import pytest

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.store import AdapterStore
from kiln.evals.jobs import EvalJob
from kiln.evals.suite import parse_suite
from kiln.train.executor import JobContext
from kiln.train.gate_actions import demote_adapter, resolve_gate
from kiln.train.jobs import TrainJob
from tests.adapters.helpers import save_random

SUITE = parse_suite({"name": "held", "default_scorer": {"kind": "exact_match"}, "schema_version": 2,
                     "examples": [{"messages": [{"role": "user", "content": "q"}], "target": "a"}]})
GATE = {"suite": "held", "data_scope": "held-out", "min_accuracy": 0.5, "auto_load_on_pass": True,
        "include_baseline": True, "gate_policy": "paired_wilson_v1"}


def run(adapter, passes: bool) -> dict:
    return {"adapter": adapter, "aggregated_outcomes": [
        {"example_id": f"e{i}", "kind": "pass" if passes else "fail", "score": 1.0 if passes else 0.0}
        for i in range(20)]}


def eval_job(state="completed", cand_passes=True) -> EvalJob:
    job = EvalJob("eval-1", SUITE, [None, "cand"], "post_training", 1, state=state)
    job.runs = [run(None, False), run("cand", cand_passes)]
    return job


@pytest.fixture
def store(tmp_path):
    s = AdapterStore(tmp_path / "adapters")
    save_random(s, "cand")
    return s


def train_job(store) -> TrainJob:
    job = TrainJob("train-1", "sft", "cand", {}, {}, "2026-01-01T00:00:00Z", state="completed",
                   post_eval=dict(GATE), gate_outcome="pending")
    job.train_receipt = {"adapter_content_sha256": store.content_hash("cand")}
    return job


def test_promotion_activates_the_trained_adapter(store):
    active = ActiveAdapter(store)
    job = train_job(store)
    resolve_gate(job, eval_job(), lambda: JobContext(None, store, active))
    assert job.gate_outcome == "promoted" and active.name == "cand" and job.activated is True
    assert job.post_eval_gate_evidence["eval_job_id"] == "eval-1"


def test_an_adapter_changed_since_training_is_not_promoted(store):
    active = ActiveAdapter(store)
    job = train_job(store)
    store.delete("cand")
    save_random(store, "cand", seed=7)
    resolve_gate(job, eval_job(), lambda: JobContext(None, store, active))
    assert job.gate_outcome == "error" and active.name is None
    assert job.post_eval_gate_evidence["failed_outcome"] == "promoted" and "changed" in job.post_eval_verdict
    assert job.post_eval_gate_evidence["num_paired"] == 20  # the numbers survive the failure


def test_a_failed_swap_is_an_error(store):
    job = train_job(store)
    resolve_gate(job, eval_job(), lambda: JobContext(None, store, None))
    assert job.gate_outcome == "error" and job.activated is False


def test_no_server_context_is_an_error():
    def context():
        raise RuntimeError("no engine")

    job = TrainJob("train-1", "sft", "cand", {}, {}, "t", post_eval=dict(GATE), gate_outcome="pending")
    resolve_gate(job, eval_job(), context)
    assert job.gate_outcome == "error"


def test_demotion_unloads_an_active_adapter_and_replaces_an_older_failure(store):
    active = ActiveAdapter(store)
    active.load("cand")
    (store.root / "cand.failed").mkdir()
    (store.root / "cand.failed" / "old").write_text("x")
    dest = demote_adapter("cand", JobContext(None, store, active))
    assert active.name is None and dest.name == "cand.failed" and not store.exists("cand")
    assert (dest / "adapter_config.json").is_file() and not (dest / "old").exists()
