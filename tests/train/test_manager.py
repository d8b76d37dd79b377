"""The training queue: order, caps, cancel, records on disk, webhooks (with a stand-in for training)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.errors import KilnError
from kiln.train.executor import JobContext
from kiln.train.job_store import INTERRUPTED, TrainJobStore
from kiln.train.loop import Cancelled
from kiln.train.manager import TrainingManager
from kiln.train.plan import plan_sft
from kiln.train.requests import SftRequest

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


class FakeTraining:
    """Stands in for `execute`: steps only when the test releases it, and honours cancel between steps."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.release = threading.Semaphore(0)
        self.started: list[str] = []
        self.fail: set[str] = set()

    def __call__(self, job, plan, ctx, *, on_update, should_stop) -> None:
        self.started.append(job.job_id)
        for step in range(1, self.steps + 1):
            if should_stop():
                raise Cancelled()
            assert self.release.acquire(timeout=10)
            if job.job_id in self.fail:
                raise RuntimeError("boom")
            job.step, job.progress, job.current_loss = step, step / self.steps, 1.0 / step
            on_update()

    def finish(self, n: int = 1) -> None:
        for _ in range(n * self.steps):
            self.release.release()


@pytest.fixture
def adapters(tmp_path):
    return AdapterStore(tmp_path / "adapters")


@pytest.fixture
def make_plan(engine_view, adapters):
    def make():
        return plan_sft(parse_model(SftRequest, {"examples": [GOOD]}), engine_view, adapters, None)
    return make


def manager(tmp_path, adapters, fake, **kw) -> TrainingManager:
    return TrainingManager(TrainJobStore(tmp_path / "jobs"), lambda: JobContext(None, adapters), run=fake, **kw)


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_jobs_run_one_at_a_time_in_submission_order(tmp_path, adapters, make_plan):
    fake = FakeTraining()
    m = manager(tmp_path, adapters, fake)
    a, b = m.submit(make_plan()), m.submit(make_plan())
    wait_for(lambda: a.state == "running")
    assert b.state == "queued" and m.queue_view()["queued"][0]["position"] == 1
    fake.finish(2)
    wait_for(lambda: b.state == "completed")
    assert fake.started == [a.job_id, b.job_id] and a.state == "completed" and a.progress == 1.0


def test_a_full_queue_answers_503_with_retry_after_30(tmp_path, adapters, make_plan):
    fake = FakeTraining()
    m = manager(tmp_path, adapters, fake, max_queued_jobs=1)
    first = m.submit(make_plan())
    wait_for(lambda: first.state == "running")
    m.submit(make_plan())
    with pytest.raises(KilnError) as e:
        m.submit(make_plan())
    assert (e.value.status, e.value.code, e.value.headers) == (503, "training_queue_full", {"Retry-After": "30"})
    fake.finish(2)


def test_the_tracked_cap_forgets_the_oldest_finished_job_first(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=1)
    m = manager(tmp_path, adapters, fake, max_tracked_jobs=2)
    done = m.submit(make_plan())
    fake.finish()
    wait_for(lambda: done.terminal)
    running = m.submit(make_plan())
    wait_for(lambda: running.state == "running")
    m.submit(make_plan())
    assert done.job_id not in [j.job_id for j in m.list()]
    assert not (tmp_path / "jobs" / f"{done.job_id}.json").exists()
    with pytest.raises(KilnError) as e:
        m.submit(make_plan())
    assert (e.value.status, e.value.code) == (503, "training_tracked_full")
    fake.finish(2)


def test_two_unfinished_jobs_may_not_write_the_same_adapter(tmp_path, adapters, engine_view):
    fake = FakeTraining()
    m = manager(tmp_path, adapters, fake)
    body = {"examples": [GOOD], "config": {"output_name": "same"}}
    m.submit(plan_sft(parse_model(SftRequest, body), engine_view, adapters, None))
    with pytest.raises(KilnError) as e:
        m.submit(plan_sft(parse_model(SftRequest, body), engine_view, adapters, None))
    assert (e.value.status, e.value.code, e.value.param) == (409, "adapter_already_exists", "config.output_name")
    fake.finish()


def test_cancelling_a_queued_job_takes_it_off_the_queue(tmp_path, adapters, make_plan):
    fake = FakeTraining()
    m = manager(tmp_path, adapters, fake)
    first, second = m.submit(make_plan()), m.submit(make_plan())
    wait_for(lambda: first.state == "running")
    assert m.cancel_queued(second.job_id) == {"status": "cancelled", "job_id": second.job_id}
    assert second.state == "cancelled" and m.queue_view()["queued"] == []
    with pytest.raises(KilnError) as e:
        m.cancel_queued(first.job_id)
    assert (e.value.status, e.value.code) == (409, "training_job_already_started")
    fake.finish()
    wait_for(lambda: first.terminal)
    assert fake.started == [first.job_id]


def test_a_running_job_stops_at_the_next_step_boundary(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=5)
    m = manager(tmp_path, adapters, fake)
    job = m.submit(make_plan())
    fake.release.release()
    wait_for(lambda: job.step == 1)
    assert m.cancel_or_delete(job.job_id)["status"] == "cancelling"
    fake.finish()  # permits for every step: only the cancel can stop it early
    wait_for(lambda: job.terminal)
    assert job.state == "cancelled" and job.step <= 2


def test_deleting_a_finished_job_forgets_it_and_its_record(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=1)
    m = manager(tmp_path, adapters, fake)
    job = m.submit(make_plan())
    fake.finish()
    wait_for(lambda: job.terminal)
    assert m.cancel_or_delete(job.job_id) == {"status": "deleted", "job_id": job.job_id, "removed_record_file": True}
    with pytest.raises(KilnError) as e:
        m.get(job.job_id)
    assert (e.value.status, e.value.code) == (404, "training_job_not_found")
    with pytest.raises(KilnError) as e:
        m.cancel_queued(job.job_id)
    assert e.value.status == 404


def test_a_failing_job_is_failed_with_its_error_and_the_next_one_runs(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=1)
    m = manager(tmp_path, adapters, fake)
    bad = make_plan()
    fake.fail.add(bad.job_id)
    failed, ok = m.submit(bad), m.submit(make_plan())
    fake.finish(2)
    wait_for(lambda: ok.terminal)
    assert failed.state == "failed" and failed.error == "RuntimeError: boom" and ok.state == "completed"


def test_records_are_on_disk_and_a_restart_fails_interrupted_jobs(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=3)
    m = manager(tmp_path, adapters, fake)
    job = m.submit(make_plan())
    fake.release.release()
    wait_for(lambda: job.step == 1)
    on_disk = json.loads((tmp_path / "jobs" / f"{job.job_id}.json").read_text())
    assert on_disk["state"] == "running" and on_disk["training_data"]["source"] == "inline"
    restarted = manager(tmp_path, adapters, FakeTraining())
    restarted.load_archived()
    again = restarted.get(job.job_id)
    assert again.state == "failed" and again.error == INTERRUPTED
    m.close()
    fake.finish()


def test_the_webhook_receives_the_terminal_state(tmp_path, adapters, make_plan):
    fake = FakeTraining(steps=1)
    sent = []
    m = manager(tmp_path, adapters, fake, webhook_url="http://hooks.invalid/train",
                send_webhook=lambda url, payload: sent.append((url, payload)) or {"url": url, "status_code": 204})
    job = m.submit(make_plan())
    fake.finish()
    wait_for(lambda: job.webhook is not None)
    url, payload = sent[0]
    assert url == "http://hooks.invalid/train"
    assert {k: payload[k] for k in ("job_id", "job_type", "status", "adapter_name", "error")} == {
        "job_id": job.job_id, "job_type": "sft", "status": "completed", "adapter_name": job.adapter_name,
        "error": None}
    assert payload["timestamp"].endswith("Z") and job.webhook["status_code"] == 204
