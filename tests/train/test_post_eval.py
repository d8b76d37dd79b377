"""Submission-time checks of a training request's `post_eval` block (semantics.md §8.14)."""

from __future__ import annotations

import pytest

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.errors import KilnError
from kiln.evals.suite import parse_suite
from kiln.evals.suite_store import SuiteStore
from kiln.testing.schemas import validate
from kiln.train.errors import CODE, PREFIX
from kiln.train.eval_link import build_eval_job
from kiln.train.plan import plan_grpo, plan_sft
from kiln.train.requests import GrpoRequest, SftRequest

TRAIN = {"messages": [{"role": "user", "content": "Capital of Zorbania?"}, {"role": "assistant", "content": "Quillton"}]}
EVALS = "kiln-evals-v1.schema.json"


@pytest.fixture
def adapters(tmp_path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")


@pytest.fixture
def suites(tmp_path) -> SuiteStore:
    store = SuiteStore(tmp_path / "suites")
    held = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}?"}], "target": "a"}
            for i in range(3)]
    store.save(parse_suite({"name": "held", "default_scorer": {"kind": "exact_match"}, "schema_version": 2,
                            "examples": held}))
    leaky = [*held, {"id": "leak", "messages": [{"role": "user", "content": "capital of  ZORBANIA?"}], "target": "b"}]
    store.save(parse_suite({"name": "leaky", "default_scorer": {"kind": "exact_match"}, "schema_version": 2,
                            "examples": leaky}))
    return store


def sft(post_eval, engine_view, adapters, suites, **config):
    body = {"examples": [TRAIN], "post_eval": post_eval, "config": config}
    return plan_sft(parse_model(SftRequest, body, code=CODE, prefix=PREFIX), engine_view, adapters, None, suites)


def rejected(fn, *args, **kw) -> KilnError:
    with pytest.raises(KilnError) as e:
        fn(*args, **kw)
    return e.value


def test_a_held_out_post_eval_plans_a_gate_with_its_defaults(engine_view, adapters, suites):
    plan = sft({"suite": "held", "min_accuracy": 0.25, "absolute_gain": 0.1}, engine_view, adapters, suites)
    pe = plan.post_eval
    assert plan.gated and pe.include_baseline and pe.gate.auto_load_on_pass is True
    assert pe.settings == {"suite": "held", "suite_hash": pe.settings["suite_hash"], "data_scope": "held-out",
                           "min_accuracy": 0.25, "absolute_gain": 0.1, "auto_load_on_pass": True,
                           "include_baseline": True, "gate_policy": "paired_wilson_v1"}


def test_auto_load_on_pass_follows_config_auto_load_unless_given(engine_view, adapters, suites):
    assert sft({"suite": "held"}, engine_view, adapters, suites, auto_load=False).post_eval.gate.auto_load_on_pass is False
    plan = sft({"suite": "held", "auto_load_on_pass": True}, engine_view, adapters, suites, auto_load=False)
    assert plan.post_eval.gate.auto_load_on_pass is True


def test_the_eval_job_carries_a_schema_valid_post_eval_gate(engine_view, adapters, suites):
    plan = sft({"suite": "held", "min_accuracy": 0.5}, engine_view, adapters, suites)
    job = build_eval_job(plan.post_eval, plan.adapter_name, plan.job_id, "previous")
    assert job.adapters == ["previous", plan.adapter_name] and job.submission_kind == "post_training"
    info = job.info()
    validate(EVALS, "EvalJobInfo", info)
    validate(EVALS, "PostEvalGate", info["post_eval_gate"])
    assert info["source_training_job_id"] == plan.job_id
    assert info["post_eval_gate"] == {"min_accuracy": 0.5, "adapter_name": plan.adapter_name,
                                      "training_job_id": plan.job_id, "auto_load_on_pass": True}


def test_train_set_eval_gates_nothing(engine_view, adapters, suites):
    plan = sft({"suite": "leaky", "data_scope": "train-set-eval"}, engine_view, adapters, suites)
    assert not plan.gated and plan.post_eval.include_baseline is False  # overlap is the point here
    job = build_eval_job(plan.post_eval, plan.adapter_name, plan.job_id, None)
    assert job.adapters == [plan.adapter_name] and job.post_eval_gate is None
    with_base = sft({"suite": "held", "data_scope": "train-set-eval", "include_baseline": True},
                    engine_view, adapters, suites)
    assert build_eval_job(with_base.post_eval, "x", "t", None).adapters == [None, "x"]


@pytest.mark.parametrize("key, value", [("min_accuracy", 0.5), ("relative_recovery", 0.9), ("absolute_gain", 0.0),
                                        ("auto_load_on_pass", False)])
def test_train_set_eval_refuses_gate_settings(engine_view, adapters, suites, key, value):
    err = rejected(sft, {"suite": "held", "data_scope": "train-set-eval", key: value}, engine_view, adapters, suites)
    assert (err.status, err.code, err.param) == (400, CODE, f"post_eval.{key}")


def test_a_held_out_suite_overlapping_the_training_data_is_refused_before_queuing(engine_view, adapters, suites):
    err = rejected(sft, {"suite": "leaky"}, engine_view, adapters, suites)
    assert (err.status, err.code, err.param) == (400, CODE, "post_eval.suite")
    assert "'leak'" in err.message and "1 of 4" in err.message and "train-set-eval" in err.hint


def test_grpo_checks_overlap_too(engine_view, adapters, suites):
    group = {"messages": [{"role": "user", "content": "Question 1?"}],
             "completions": [{"text": "a", "reward": 1.0}, {"text": "b", "reward": 0.0}]}
    body = {"groups": [group], "post_eval": {"suite": "held"}}
    err = rejected(plan_grpo, parse_model(GrpoRequest, body, code=CODE), engine_view, adapters, None, suites)
    assert err.param == "post_eval.suite" and "'q1'" in err.message


def test_unknown_and_badly_named_suites_answer_like_the_eval_api(engine_view, adapters, suites):
    err = rejected(sft, {"suite": "nope"}, engine_view, adapters, suites)
    assert (err.status, err.code, err.param) == (404, "eval_suite_not_found", "post_eval.suite")
    err = rejected(sft, {"suite": "../x"}, engine_view, adapters, suites)
    assert (err.status, err.code, err.param) == (400, "invalid_suite_name", "post_eval.suite")
    err = rejected(sft, {"suite": "held"}, engine_view, adapters, None)
    assert (err.status, err.code) == (503, "eval_registry_unavailable")


@pytest.mark.parametrize("post_eval, param", [
    ({"suite": "held", "min_accuracy": 1.5}, "post_eval.min_accuracy"),
    ({"suite": "held", "data_scope": "holdout"}, "post_eval.data_scope"),
    ({"suite": "held", "gate": "on"}, "post_eval.gate"),
    ({"min_accuracy": 0.5}, "post_eval.suite"),
])
def test_malformed_post_eval_fields_are_400s_naming_the_field(engine_view, adapters, suites, post_eval, param):
    err = rejected(sft, post_eval, engine_view, adapters, suites)
    assert (err.status, err.param) == (400, param)


def test_a_generation_override_must_agree_with_the_suite(engine_view, adapters, suites):
    err = rejected(sft, {"suite": "held", "generation": {"n": 3}}, engine_view, adapters, suites)
    assert (err.status, err.param) == (400, "post_eval.generation.n")
    plan = sft({"suite": "held", "generation": {"max_tokens": 4, "seed": 5}}, engine_view, adapters, suites)
    assert plan.post_eval.settings["generation"]["max_tokens"] == 4
    assert build_eval_job(plan.post_eval, "x", "t", None).effective_seed == 5


def test_a_gated_job_may_not_replace_an_existing_adapter(engine_view, adapters, suites, tmp_path):
    (adapters.root / "old").mkdir(parents=True)
    err = rejected(sft, {"suite": "held"}, engine_view, adapters, suites, output_name="old", overwrite=True)
    assert (err.status, err.param) == (400, "config.output_name")
    err = rejected(sft, {"suite": "held"}, engine_view, adapters, suites, output_name="old")
    assert (err.status, err.code) == (409, "adapter_already_exists")
