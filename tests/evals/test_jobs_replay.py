"""Rerun, strict replay and the judge pass of eval jobs (semantics.md §8.12, §8.13), with a scripted generator."""

from __future__ import annotations

import asyncio
import copy

import pytest

from kiln.core.thinking_budget import ServerBudgetDefaults
from kiln.errors import KilnError
from kiln.evals.digests import hash_json, text_sha256
from kiln.evals.intake import job_for_replay, job_for_rerun, job_for_run
from kiln.evals.replay import record_sha256, replay_verdict, validate_replay_record
from kiln.evals.requests import parse_replay_body, parse_rerun_body, parse_run_request
from kiln.evals.seeds import derive_generation_seed
from kiln.testing.schemas import validate
from tests.evals.test_jobs_fixtures import SCHEMA, FakeGenerator, arithmetic, digest, make_manager, suite_data


def finished_job(tmp_path, body=None, generator=None, **kw):
    manager, gen = make_manager(tmp_path, generator, **kw)
    job = manager.submit(job_for_run(manager.ctx, parse_run_request(body or {"suite": "math", "seed": 11})))
    asyncio.run(manager.run_job(job))
    return manager, gen, job


def replay(manager, source, run_index=0):
    async def main():
        current = await manager.generator().identity()
        job = manager.submit(job_for_replay(manager.ctx, source, run_index, current))
        await manager.run_job(job)
        return job

    return asyncio.run(main())


# ---- the record ---------------------------------------------------------------------------------

def test_every_run_carries_a_schema_valid_replay_record(tmp_path):
    _, _, job = finished_job(tmp_path)
    run = job.runs[0]
    record = run["replay_record"]
    validate(SCHEMA, "EvalReplayRecordV1", record)
    assert record["suite_sha256"] == run["suite_hash"]
    assert record["effective_generation_sha256"] == run["effective_generation_hash"]
    assert record["record_sha256"] == record_sha256(record)
    assert validate_replay_record(record, outcomes=run["outcomes"], budget_defaults=ServerBudgetDefaults()) == []


def test_raw_completion_references_point_at_the_stored_bytes(tmp_path):
    _, _, job = finished_job(tmp_path)
    run = job.runs[0]
    ref = run["replay_record"]["raw_completions"][1]
    outcome = run["outcomes"][1]
    assert ref["raw_completion_pointer"] == "/outcomes/1/raw_completion_text"
    assert ref["raw_completion_sha256"] == text_sha256(outcome["raw_completion_text"])
    assert ref["generation_seed"] == str(derive_generation_seed(11, outcome["example_id"], 0))


def test_hash_json_separates_domains_and_lengths():
    assert hash_json("a\0", {"x": 1}) != hash_json("b\0", {"x": 1})
    assert hash_json("a\0", {"x": 1, "y": 2}) != hash_json("a\0", {"y": 2, "x": 1})  # field order counts


@pytest.mark.parametrize("tamper", [
    lambda r: r["raw_completions"][0].update(raw_completion_sha256=digest("0")),
    lambda r: r["suite"].update(description="edited"),
    lambda r: r.update(effective_seed="12"),
    lambda r: r["raw_completions"].pop(),
    lambda r: r.pop("execution_provenance_sha256"),
    lambda r: r["resolved_thinking_budgets"].pop(),
    lambda r: r["scorer_identities"][0].update(kind="regex"),
])
def test_a_tampered_record_fails_strict_validation(tmp_path, tamper):
    _, _, job = finished_job(tmp_path)
    record = copy.deepcopy(job.runs[0]["replay_record"])
    tamper(record)
    assert validate_replay_record(record) != []


def test_stored_completion_bytes_must_match_their_digests(tmp_path):
    _, _, job = finished_job(tmp_path)
    outcomes = copy.deepcopy(job.runs[0]["outcomes"])
    outcomes[0]["raw_completion_text"] = "changed"
    assert validate_replay_record(job.runs[0]["replay_record"], outcomes=outcomes) != []


def test_changed_server_thinking_defaults_fail_strict_validation(tmp_path):
    _, _, job = finished_job(tmp_path)
    problems = validate_replay_record(job.runs[0]["replay_record"],
                                      budget_defaults=ServerBudgetDefaults(tokens=64))
    assert problems and "thinking budget" in problems[0]


# ---- replay -------------------------------------------------------------------------------------

def test_replaying_a_seeded_run_on_an_unchanged_server_matches(tmp_path):
    manager, _, source = finished_job(tmp_path, {"suite": "math", "seed": 11, "generation": {"temperature": 0.7}})
    job = replay(manager, source)
    assert job.replay_expectation == {
        "expectation_type": "kiln.eval-replay-expectation.v1", "source_job_id": source.job_id, "source_run_index": 0,
        "expected_record_sha256": source.runs[0]["replay_record"]["record_sha256"],
        "expected_raw_completion_set_sha256": source.runs[0]["replay_record"]["raw_completion_set_sha256"],
    }
    assert job.replay_verdict["status"] == "matched"
    validate(SCHEMA, "EvalResult", job.result())
    validate(SCHEMA, "EvalJobInfo", job.info())


def test_a_replay_whose_completions_differ_is_a_mismatch(tmp_path):
    manager, gen, source = finished_job(tmp_path)
    gen.answer = lambda req: arithmetic(req) + "!"
    job = replay(manager, source)
    assert job.replay_verdict["status"] == "mismatch"
    assert "raw completion set" in job.replay_verdict["message"]


def test_a_replay_that_fails_has_an_error_verdict():
    expectation = {"source_job_id": "eval-1", "source_run_index": 0, "expected_record_sha256": digest("a"),
                   "expected_raw_completion_set_sha256": digest("b")}
    verdict = replay_verdict(expectation, None, error="the replay job ended failed")
    validate(SCHEMA, "EvalReplayVerdict", verdict)
    assert verdict["status"] == "error"


def test_replay_is_refused_when_the_execution_provenance_changed(tmp_path):
    manager, gen, source = finished_job(tmp_path)
    gen.provenance = {"engine": "fake", "version": 2}
    with pytest.raises(KilnError) as e:
        replay(manager, source)
    assert (e.value.status, e.value.code) == (400, "eval_invalid_request")
    assert "execution provenance" in e.value.message


def test_replay_is_refused_when_the_adapter_changed(tmp_path):
    adapters = {"tuned": digest("c")}
    manager, _, source = finished_job(tmp_path, {"suite": "math", "adapter": "tuned"}, adapters=adapters)
    adapters["tuned"] = digest("d")
    with pytest.raises(KilnError) as e:
        replay(manager, source)
    assert "changed since the source run" in e.value.message


def test_replay_needs_a_completed_job_and_an_existing_run(tmp_path):
    manager, _, source = finished_job(tmp_path)
    with pytest.raises(KilnError) as e:
        replay(manager, source, run_index=1)
    assert e.value.param == "run_index"
    source.state = "cancelled"
    with pytest.raises(KilnError):
        replay(manager, source)


def test_replay_body_rejects_unknown_fields():
    assert parse_replay_body(None) == 0
    assert parse_replay_body({"run_index": 2}) == 2
    with pytest.raises(KilnError) as e:
        parse_replay_body({"run_index": 0, "force": True})
    assert (e.value.code, e.value.param) == ("eval_invalid_request", "force")


# ---- rerun --------------------------------------------------------------------------------------

def test_rerun_queues_only_the_failing_examples_with_the_same_seeds(tmp_path):
    data = suite_data(default_scorer={"kind": "numeric_tolerance"}, generation={"temperature": 1.0})
    manager, gen, source = finished_job(tmp_path, {"inline_suite": data, "seed": 11})
    job = manager.submit(job_for_rerun(manager.ctx, source, parse_rerun_body({})))
    asyncio.run(manager.run_job(job))
    assert [ex.id for ex in job.suite.examples] == ["three"]
    assert (job.submission_kind, job.effective_seed, job.suite.generation.seed) == ("on_demand", 11, 11)
    assert job.runs[0]["outcomes"][0]["raw_completion_text"] == source.runs[0]["outcomes"][1]["raw_completion_text"]


def test_rerun_with_include_pass_and_a_new_seed(tmp_path):
    manager, _, source = finished_job(tmp_path)
    job = job_for_rerun(manager.ctx, source, parse_rerun_body({"include_pass": True, "seed": "5"}))
    assert [ex.id for ex in job.suite.examples] == ["two", "three", "five"]
    assert job.effective_seed == 5


def test_rerun_with_nothing_to_rerun_is_400(tmp_path):
    manager, _, source = finished_job(tmp_path)
    with pytest.raises(KilnError) as e:
        job_for_rerun(manager.ctx, source, parse_rerun_body({"outcome_kinds": ["invalid"]}))
    assert (e.value.status, e.value.code) == (400, "eval_invalid_request")
    assert "no matching outcomes to re-run" in e.value.message


def test_rerun_rejects_unknown_outcome_kinds():
    with pytest.raises(KilnError) as e:
        parse_rerun_body({"outcome_kinds": ["wrong"]})
    assert e.value.param == "outcome_kinds"


# ---- judge pass ---------------------------------------------------------------------------------

def test_judge_scored_examples_ask_the_judge_once_per_prompt(tmp_path):
    data = suite_data(default_scorer={"kind": "llm_judge"}, aggregation={"kind": "mean_at_k", "k": 3},
                      generation={"n": 3})

    def answer(req):
        return "Score: 1" if "strict grader" in str(req.messages[-1]["content"]) else "4"

    manager, gen, job = finished_job(tmp_path, {"inline_suite": data, "seed": 1}, FakeGenerator(answer))
    judge_calls = [r for r in gen.requests() if r.label.startswith("judge#")]
    assert len(judge_calls) == 3  # 9 greedy completions, one distinct prompt per example
    outcomes = job.runs[0]["outcomes"]
    assert len(outcomes) == 9 and {o["kind"] for o in outcomes} == {"pass"}
    record = job.runs[0]["replay_record"]
    assert record["judge_targets"] == [{}]
    assert all(s["requires_judge"] for s in record["scorer_identities"])
    assert validate_replay_record(record, outcomes=job.runs[0]["outcomes"]) == []
