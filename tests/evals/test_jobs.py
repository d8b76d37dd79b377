"""The eval job queue (semantics.md §8.9-8.11) with a scripted generator: no model, no HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest

from kiln.errors import KilnError
from kiln.evals.intake import job_for_compare, job_for_run
from kiln.evals.job_store import INTERRUPTED, EvalJobStore
from kiln.evals.requests import parse_compare_spec, parse_run_request
from kiln.evals.seeds import derive_generation_seed
from kiln.testing.schemas import validate
from tests.evals.test_jobs_fixtures import (
    SCHEMA,
    FakeGenerator,
    make_manager,
    no_model,
    suite_data,
    wait_until,
)


def run(coro):
    return asyncio.run(coro)


def submit(manager, body):
    return manager.submit(job_for_run(manager.ctx, parse_run_request(body)))


def test_a_run_scores_every_example_and_completes(tmp_path):
    async def main():
        manager, _ = make_manager(tmp_path)
        manager.start_worker()
        job = submit(manager, {"suite": "math", "seed": 1})
        await wait_until(lambda: job.terminal)
        return job

    job = run(main())
    assert job.state == "completed"
    result = job.result()
    validate(SCHEMA, "EvalResult", result)
    metrics = result["runs"][0]["metrics"]
    assert (metrics["num_pass"], metrics["num_fail"]) == (2, 1)
    assert "progress" not in result and "error" not in result


def test_a_job_logs_when_it_is_queued_and_how_it_ended(tmp_path, caplog):
    async def main():
        manager, _ = make_manager(tmp_path)
        manager.start_worker()
        job = submit(manager, {"suite": "math", "seed": 1})
        await wait_until(lambda: job.terminal)
        return job

    with caplog.at_level("INFO", logger="kiln.evals"):
        job = run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.evals"]
    assert f"queued on_demand eval job {job.job_id}: suite math (3 examples) on <base>" in lines
    assert f"eval job {job.job_id} (math) completed: <base> 66.7% of 3" in lines


def test_a_run_sends_all_its_examples_to_the_generator_together(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        await manager.run_job(submit(manager, {"suite": "math"}))
        return gen

    gen = run(main())
    assert gen.max_in_flight == 3  # one generate call per example, all in flight at once


def test_jobs_run_one_at_a_time_in_submission_order(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        seen: list[str] = []
        answer = gen.answer
        gen.answer = lambda req: (seen.append(manager._active.job_id), answer(req))[1]
        manager.start_worker()
        first = submit(manager, {"suite": "math"})
        second = submit(manager, {"suite": "math"})
        await wait_until(lambda: second.terminal)
        return first, second, seen

    first, second, seen = run(main())
    assert seen == [first.job_id] * 3 + [second.job_id] * 3
    assert first.finished_at <= second.started_at


def test_completion_seeds_are_derived_from_the_job_seed(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        await manager.run_job(submit(manager, {"suite": "math", "seed": 42}))
        return gen

    gen = run(main())
    assert {r.label: r.seed for r in gen.requests()} == {
        f"{eid}#0": derive_generation_seed(42, eid, 0) for eid in ("two", "three", "five")
    }


def test_an_example_generation_seed_is_the_root_for_its_completions(tmp_path):
    data = suite_data()
    data["examples"][0]["generation"] = {"seed": 5}

    async def main():
        manager, gen = make_manager(tmp_path)
        await manager.run_job(submit(manager, {"inline_suite": data, "seed": 42}))
        return gen

    seeds = {r.label: r.seed for r in run(main()).requests()}
    assert seeds["two#0"] == derive_generation_seed(5, "two", 0)
    assert seeds["three#0"] == derive_generation_seed(42, "three", 0)


def test_job_seed_falls_back_to_the_run_generation_seed(tmp_path):
    manager, _ = make_manager(tmp_path)
    job = submit(manager, {"suite": "math", "generation": {"seed": 9}})
    assert job.effective_seed == 9
    assert submit(manager, {"suite": "math", "seed": "12", "generation": {"seed": 9}}).effective_seed == 12


def test_progress_counts_finished_examples_while_running(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        gen.hold = {"5 + 5?"}
        manager.start_worker()
        job = submit(manager, {"suite": "math"})
        await wait_until(lambda: job.progress is not None and job.progress.examples_completed == 2)
        info = job.info()
        gen.release.set()
        await wait_until(lambda: job.terminal)
        return info, job

    info, job = run(main())
    validate(SCHEMA, "EvalJobInfo", info)
    assert info["state"] == "running"
    assert info["progress"] == {"examples_completed": 2, "examples_total": 3, "running_accuracy": 0.5,
                                "running_mean_score": 0.5}
    assert job.progress.examples_completed == 3


def test_cancelling_a_queued_job_removes_it_from_the_queue(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        gen.hold = {"2 + 2?"}
        manager.start_worker()
        running = submit(manager, {"suite": "math"})
        queued = submit(manager, {"suite": "math"})
        await gen.started.wait()
        answer = manager.cancel(queued.job_id)
        gen.release.set()
        await wait_until(lambda: running.terminal)
        return manager, answer, queued

    manager, answer, queued = run(main())
    validate(SCHEMA, "CancelEvalJobResponse", answer)
    assert answer == {"status": "cancelled", "job_id": queued.job_id, "was_in_queue": True}
    assert queued.state == "cancelled" and queued.runs == []
    assert manager.store.path_for(queued.job_id).is_file()


def test_cancelling_a_running_job_keeps_the_examples_that_finished(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path)
        gen.hold = {"5 + 5?"}
        manager.start_worker()
        job = submit(manager, {"suite": "math"})
        await wait_until(lambda: job.progress is not None and job.progress.examples_completed == 2)
        answer = manager.cancel(job.job_id)
        await wait_until(lambda: job.finished_at is not None)
        return answer, job, gen

    answer, job, gen = run(main())
    validate(SCHEMA, "CancelEvalJobResponse", answer)
    assert answer["status"] == "cancelling"
    assert job.state == "cancelled"
    assert [o["example_id"] for o in job.runs[0]["outcomes"]] == ["two", "three"]
    assert "replay_record" not in job.runs[0]  # a partial run cannot be replayed
    assert gen.cancelled == 1  # the held example's generation was abandoned
    validate(SCHEMA, "EvalResult", job.result())


def test_deleting_a_finished_job_removes_its_archive(tmp_path):
    async def main():
        manager, _ = make_manager(tmp_path)
        job = submit(manager, {"suite": "math"})
        await manager.run_job(job)
        return manager, job, manager.cancel(job.job_id)

    manager, job, answer = run(main())
    validate(SCHEMA, "CancelEvalJobResponse", answer)
    assert answer == {"status": "deleted", "job_id": job.job_id, "removed_archive_file": True}
    assert not manager.store.path_for(job.job_id).exists()
    with pytest.raises(KilnError) as e:
        manager.get(job.job_id)
    assert (e.value.status, e.value.code) == (404, "eval_job_not_found")


def test_a_full_queue_answers_503_with_retry_after(tmp_path):
    manager, _ = make_manager(tmp_path, max_queued=1)
    submit(manager, {"suite": "math"})
    with pytest.raises(KilnError) as e:
        submit(manager, {"suite": "math"})
    assert (e.value.status, e.value.code, e.value.headers) == (503, "eval_queue_full", {"Retry-After": "15"})


def test_too_many_tracked_jobs_answers_503_with_retry_after(tmp_path):
    manager, _ = make_manager(tmp_path, max_tracked=1)
    job = submit(manager, {"suite": "math"})
    manager.cancel(job.job_id)  # terminal jobs still count until deleted
    with pytest.raises(KilnError) as e:
        submit(manager, {"suite": "math"})
    assert (e.value.status, e.value.code, e.value.headers["Retry-After"]) == (503, "eval_tracked_full", "15")


def test_jobs_list_newest_first(tmp_path):
    manager, _ = make_manager(tmp_path)
    ids = [submit(manager, {"suite": "math"}).job_id for _ in range(3)]
    assert [j.job_id for j in manager.all_jobs()] == ids[::-1]


def test_finished_jobs_are_reloaded_after_a_restart(tmp_path):
    async def main():
        manager, _ = make_manager(tmp_path)
        job = submit(manager, {"suite": "math", "seed": 3})
        await manager.run_job(job)
        return job

    job = run(main())
    again, _ = make_manager(tmp_path)
    assert again.load_archived() == 1
    assert again.get(job.job_id).result() == job.result()


def test_a_job_running_when_the_process_died_reloads_as_failed(tmp_path):
    manager, _ = make_manager(tmp_path)
    job = submit(manager, {"suite": "math"})
    job.state = "running"
    manager.store.save(job)  # what the running marker leaves behind

    again, _ = make_manager(tmp_path)
    again.load_archived()
    reloaded = again.get(job.job_id)
    assert (reloaded.state, reloaded.error) == ("failed", INTERRUPTED)
    assert reloaded.finished_at is not None
    validate(SCHEMA, "EvalResult", reloaded.result())
    assert json.loads(manager.store.path_for(job.job_id).read_text())["info"]["state"] == "failed"


def test_unreadable_archives_are_skipped(tmp_path):
    store = EvalJobStore(tmp_path / "jobs")
    store.root.mkdir(parents=True)
    (store.root / "eval-bad.json").write_text("{not json")
    (store.root / "eval-old.json").write_text(json.dumps({"archive_type": "something-else"}))
    assert store.load_all() == []


def test_a_job_without_a_model_fails_with_the_reason(tmp_path):
    async def main():
        manager, _ = make_manager(tmp_path)
        manager.generator_factory = no_model
        job = submit(manager, {"suite": "math"})
        await manager.run_job(job)
        return job

    job = run(main())
    assert (job.state, job.error) == ("failed", "the model is still loading")
    validate(SCHEMA, "EvalResult", job.result())


def test_generation_failures_become_error_outcomes(tmp_path):
    async def main():
        manager, _ = make_manager(tmp_path, FakeGenerator(fail_with="engine exploded"))
        job = submit(manager, {"suite": "math"})
        await manager.run_job(job)
        return job

    job = run(main())
    assert job.state == "completed"
    outcomes = job.runs[0]["outcomes"]
    assert {o["kind"] for o in outcomes} == {"error"}
    assert outcomes[0]["detail"] == "generation failed: engine exploded"


def test_an_unknown_adapter_is_404_at_admission(tmp_path):
    manager, _ = make_manager(tmp_path)
    with pytest.raises(KilnError) as e:
        submit(manager, {"suite": "math", "adapter": "ghost"})
    assert (e.value.status, e.value.code) == (404, "adapter_not_found")


def test_a_known_adapter_is_passed_to_the_generator(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path, adapters={"tuned": "sha256:" + "a" * 64})
        job = submit(manager, {"suite": "math", "adapter": "tuned"})
        await manager.run_job(job)
        return job, gen

    job, gen = run(main())
    assert {r.adapter for r in gen.requests()} == {"tuned"}
    record = job.runs[0]["replay_record"]
    assert record["model_target"] == {"adapter": "tuned", "adapter_content_sha256": "sha256:" + "a" * 64}


def test_an_omitted_adapter_means_the_active_one_and_empty_means_base(tmp_path):
    manager, _ = make_manager(tmp_path, adapters={"tuned": "sha256:" + "a" * 64}, active="tuned")
    assert submit(manager, {"suite": "math"}).adapters == ["tuned"]
    assert submit(manager, {"suite": "math", "adapter": None}).adapters == ["tuned"]
    assert submit(manager, {"suite": "math", "adapter": ""}).adapters == [None]


def test_a_run_override_whose_n_differs_from_k_is_refused(tmp_path):
    manager, _ = make_manager(tmp_path)
    with pytest.raises(KilnError) as e:
        submit(manager, {"suite": "math", "generation": {"n": 3}})
    assert (e.value.status, e.value.code, e.value.param) == (400, "eval_invalid_request", "generation.n")


def test_compare_runs_each_adapter_in_order(tmp_path):
    async def main():
        manager, gen = make_manager(tmp_path, adapters={"tuned": "sha256:" + "b" * 64})
        job = manager.submit(job_for_compare(manager.ctx, parse_compare_spec(
            {"suite": "math", "adapters": ["", "tuned", ""], "seed": 4})))
        await manager.run_job(job)
        return job, gen

    job, gen = run(main())
    assert job.submission_kind == "compare"
    assert [r["adapter"] for r in job.runs] == [None, "tuned", None]
    assert [r.adapter for r in gen.requests()] == [None] * 3 + ["tuned"] * 3 + [None] * 3
    assert job.runs[0]["outcomes"] == job.runs[2]["outcomes"]
    validate(SCHEMA, "EvalJobInfo", job.info())


def test_other_routers_can_queue_a_run_from_a_request_body(tmp_path):
    manager, _ = make_manager(tmp_path)
    job = manager.submit({"suite": "math", "adapter": ""})
    assert (job.state, job.adapters, manager.queue_position(job.job_id)) == ("queued", [None], 1)
