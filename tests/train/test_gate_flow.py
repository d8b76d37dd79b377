"""The post-training gate wired through the training manager and a real eval job manager (semantics.md
§8.14), with a stand-in for training that saves a real adapter and a scripted eval generator whose
answers depend on the adapter, so every outcome is forced deterministically."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.evals.intake import IntakeContext
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.job_store import EvalJobStore
from kiln.evals.jobs import EvalJob
from kiln.evals.suite import parse_suite
from kiln.evals.suite_store import SuiteStore
from kiln.testing.schemas import validate
from kiln.train.eval_link import EvalLink
from kiln.train.executor import JobContext
from kiln.train.job_store import TrainJobStore
from kiln.train.manager import TrainingManager
from kiln.train.plan import plan_sft
from kiln.train.requests import SftRequest
from tests.adapters.helpers import save_random
from tests.evals.test_jobs_fixtures import FakeGenerator

EVALS = "kiln-evals-v1.schema.json"
TRAIN_ROW = {"messages": [{"role": "user", "content": "Teach me"}, {"role": "assistant", "content": "ok"}]}


def held_suite(name: str, n: int) -> dict[str, Any]:
    return {"name": name, "default_scorer": {"kind": "exact_match"}, "schema_version": 2,
            "examples": [{"id": f"q{i:02d}", "messages": [{"role": "user", "content": f"Q{i}"}], "target": "yes"}
                         for i in range(n)]}


def save_adapter(store: AdapterStore, job, plan) -> None:
    """Stands in for `execute`: saves a real adapter (what the gate promotes or demotes), activates nothing."""
    save_random(store, plan.adapter_name, seed=hash(plan.adapter_name) % 1000)
    job.adapter_path = str(store.path(plan.adapter_name))
    job.train_receipt = {"adapter_content_sha256": store.content_hash(plan.adapter_name)}
    job.progress = 1.0


class Rig:
    """A training manager and an eval manager on a live event loop, sharing an adapter store."""

    def __init__(self, root, answer) -> None:
        self.adapters = AdapterStore(root / "adapters")
        self.active = ActiveAdapter(self.adapters)
        self.suites = SuiteStore(root / "suites")
        for name, n in (("held", 20), ("small", 3)):
            self.suites.save(parse_suite(held_suite(name, n)))
        self.gen = FakeGenerator(answer)

        def resolve(adapter):
            if adapter is None:
                return {}
            self.adapters.require(adapter, param="adapter")
            return {"adapter": adapter, "adapter_content_sha256": self.adapters.content_hash(adapter)}

        ctx = IntakeContext(self.suites, resolve, lambda: self.active.name)
        self.evals = EvalJobManager(EvalJobStore(root / "eval-jobs"), ctx, lambda: self.gen)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        link = EvalLink(self.evals)
        link.bind_loop(self.loop)
        self.webhooks: list[dict] = []
        self.train = TrainingManager(TrainJobStore(root / "train-jobs"), self.context,
                                     run=lambda job, plan, ctx, **_: save_adapter(self.adapters, job, plan),
                                     eval_link=link, webhook_url="http://hook.invalid/x",
                                     send_webhook=lambda url, payload: self.webhooks.append(payload) or {"url": url})
        self.evals.listeners.append(self.train.on_eval_finished)

    def context(self) -> JobContext:
        return JobContext(None, self.adapters, self.active)

    def submit(self, post_eval: dict, **config):
        body = {"examples": [TRAIN_ROW], "post_eval": post_eval, "config": config}
        plan = plan_sft(parse_model(SftRequest, body), _engine_view(), self.adapters, None, self.suites)
        return self.train.submit(plan)

    def settle(self, job, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not (job.terminal and job.gate_outcome != "pending" and job.post_eval_verdict is not None
                   and (job.gate_outcome is None or self.webhooks_for(job))):
            assert time.monotonic() < deadline, f"gate did not resolve: {job.status()}"
            time.sleep(0.01)
        return job

    def webhooks_for(self, job) -> list[dict]:
        return [w for w in self.webhooks if w["job_id"] == job.job_id]

    def close(self) -> None:
        self.train.close()
        asyncio.run_coroutine_threadsafe(self.evals.aclose(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


_VIEW: list = []


def _engine_view():
    return _VIEW[0]


@pytest.fixture(autouse=True)
def _view(engine_view):
    _VIEW[:] = [engine_view]


@pytest.fixture
def rig_for(tmp_path):
    rigs = []

    def make(answer) -> Rig:
        rigs.append(Rig(tmp_path, answer))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def wait_pending(job) -> str:
    deadline = time.monotonic() + 10
    while job.gate_outcome != "pending" or not job.linked_eval_job_ids:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return job.linked_eval_job_ids[0]


def by_adapter(passes: dict[str | None, bool]):
    return lambda req: "yes" if passes.get(req.adapter, False) else "no"


def test_a_passing_gate_promotes_the_adapter_and_the_status_shows_the_evidence(rig_for):
    rig = rig_for(lambda req: "yes" if req.adapter else "no")  # candidate right everywhere, base wrong
    job = rig.settle(rig.submit({"suite": "held", "min_accuracy": 0.5}, output_name="cand"))
    assert job.state == "completed" and job.gate_outcome == "promoted"
    assert rig.active.name == "cand" and job.activated is True
    ev = job.post_eval_gate_evidence
    assert ev["num_paired"] == 20 and ev["improved"] == 20 and ev["candidate_passes"] == 20
    assert ev["baseline_adapter"] is None and ev["action"] == "activated"
    assert ev["p_value"] == pytest.approx(2 / 2**20)
    assert "promoted" in job.post_eval_verdict and "now active" in job.post_eval_verdict
    status = job.status()
    assert status["gate_outcome"] == "promoted" and status["post_eval_gate_evidence"] == ev
    assert status["linked_eval_job_ids"] == job.linked_eval_job_ids and len(job.linked_eval_job_ids) == 1
    json.dumps(job.detail())  # the record is plain JSON
    eval_job = rig.evals.get(job.linked_eval_job_ids[0])
    info = eval_job.info()
    validate(EVALS, "EvalJobInfo", info)
    validate(EVALS, "EvalResult", eval_job.result())
    assert info["submission_kind"] == "post_training" and info["source_training_job_id"] == job.job_id
    assert info["adapters"] == [None, "cand"]
    assert info["post_eval_gate"] == {"min_accuracy": 0.5, "adapter_name": "cand", "training_job_id": job.job_id,
                                      "auto_load_on_pass": True}
    archived = EvalJob.from_archive(eval_job.to_archive())  # a restart keeps the link and the gate
    assert archived.info()["post_eval_gate"] == info["post_eval_gate"]
    assert archived.source_training_job_id == job.job_id
    (hook,) = rig.webhooks_for(job)  # sent once, after the gate
    assert hook["gate_outcome"] == "promoted" and hook["status"] == "completed"


def test_while_the_gate_is_pending_the_previous_adapter_stays_active(rig_for, tmp_path):
    rig = rig_for(by_adapter({"cand": True}))
    save_random(rig.adapters, "prev")
    rig.active.load("prev")
    rig.gen.hold.add("Q0")  # keep the eval job running until released
    job = rig.submit({"suite": "held", "min_accuracy": 0.5}, output_name="cand")
    eval_id = wait_pending(job)
    record = tmp_path / "train-jobs" / f"{job.job_id}.json"
    deadline = time.monotonic() + 10
    while not (rig.gen.started.is_set() and json.loads(record.read_text())["linked_eval_job_ids"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert job.state == "completed" and job.gate_outcome == "pending" and rig.active.name == "prev"
    assert job.activated is None and rig.webhooks_for(job) == []
    on_disk = json.loads(record.read_text())
    assert on_disk["gate_outcome"] == "pending" and on_disk["linked_eval_job_ids"] == [eval_id]
    rig.loop.call_soon_threadsafe(rig.gen.release.set)
    rig.settle(job)
    assert job.gate_outcome == "promoted" and rig.active.name == "cand"
    assert job.post_eval_gate_evidence["baseline_adapter"] == "prev"


def test_a_candidate_below_min_accuracy_is_demoted_and_renamed(rig_for):
    rig = rig_for(by_adapter({}))  # everything wrong, baseline and candidate alike
    save_random(rig.adapters, "prev")
    rig.active.load("prev")
    job = rig.settle(rig.submit({"suite": "held", "min_accuracy": 0.5}, output_name="bad"))
    assert job.gate_outcome == "demoted" and rig.active.name == "prev"
    assert not rig.adapters.exists("bad") and (rig.adapters.root / "bad.failed").is_dir()
    assert job.adapter_path.endswith("bad.failed") and job.post_eval_gate_evidence["action"] == "renamed"
    assert "not served" in job.post_eval_verdict


def test_a_significant_regression_is_recorded_and_nothing_is_activated(rig_for):
    rig = rig_for(by_adapter({None: True}))  # base right, candidate wrong
    job = rig.settle(rig.submit({"suite": "held"}, output_name="worse"))
    assert job.gate_outcome == "regression" and rig.active.name is None and rig.adapters.exists("worse")
    assert job.post_eval_gate_evidence["regressed"] == 20


def test_too_few_pairs_is_inconclusive_and_a_pass_without_auto_load_is_kept(rig_for):
    rig = rig_for(lambda req: "yes" if req.adapter else "no")
    small = rig.settle(rig.submit({"suite": "small", "min_accuracy": 0.5}, output_name="small"))
    assert small.gate_outcome == "inconclusive" and small.post_eval_gate_evidence["num_paired"] == 3
    kept = rig.settle(rig.submit({"suite": "held", "auto_load_on_pass": False}, output_name="kept"))
    assert kept.gate_outcome == "kept" and rig.active.name is None and kept.activated is None


def test_an_eval_job_that_does_not_complete_fails_the_gate_closed(rig_for):
    rig = rig_for(lambda req: "yes" if req.adapter else "no")
    rig.gen.hold.add("Q0")
    job = rig.submit({"suite": "held"}, output_name="cand")
    eval_id = wait_pending(job)

    async def cancel():
        return rig.evals.cancel(eval_id)

    asyncio.run_coroutine_threadsafe(cancel(), rig.loop).result(5)
    rig.loop.call_soon_threadsafe(rig.gen.release.set)
    rig.settle(job)
    assert job.gate_outcome == "error" and rig.active.name is None and rig.adapters.exists("cand")
    assert "ended cancelled" in job.post_eval_verdict and "not activated" in job.post_eval_verdict


def test_a_train_set_eval_reports_without_a_gate_and_auto_loads_as_usual(rig_for):
    rig = rig_for(lambda req: "yes")
    job = rig.settle(rig.submit({"suite": "small", "data_scope": "train-set-eval"}, output_name="plain"))
    assert job.gate_outcome is None and job.post_eval_verdict.startswith("report only (train-set-eval)")
    eval_job = rig.evals.get(job.linked_eval_job_ids[0])
    assert eval_job.adapters == ["plain"] and eval_job.post_eval_gate is None
    assert "post_eval_gate" not in eval_job.info()


def test_a_gate_pending_at_restart_is_an_error(rig_for, tmp_path):
    rig = rig_for(lambda req: "yes")
    rig.gen.hold.add("Q0")
    job = rig.submit({"suite": "held"}, output_name="cand")
    wait_pending(job)
    again = TrainingManager(TrainJobStore(tmp_path / "train-jobs"), rig.context)
    again.load_archived()
    reloaded = again.get(job.job_id)
    assert reloaded.gate_outcome == "error" and "stopped before" in reloaded.post_eval_verdict
    rig.loop.call_soon_threadsafe(rig.gen.release.set)
