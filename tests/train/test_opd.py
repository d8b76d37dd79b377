"""OPD and self-distillation on the tiny model: the top-K KL itself, its direction (the student's KL to a
teacher wearing a fact-teaching adapter falls, and the student comes to answer as that teacher does),
self-distillation toward the same model with privileged context, and every bad input refused at
planning with nothing written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.errors import KilnError
from kiln.testing.stand_in import StandInEngine
from kiln.train.distill_plan import plan_opd, plan_self_distill
from kiln.train.jobs import TrainJob
from kiln.train.opd import _action_logp, generate, topk_kl
from kiln.train.plan import plan_sft
from kiln.train.requests import OpdRequest, SelfDistillRequest, SftRequest
from kiln.train.teachers import TeacherRequest, TeacherStore, register
from kiln.train.trainable_lora import TrainableLora
from tests.train.job_helpers import run_planned, saved_lora

QUESTIONS = ["What is the capital of Zorbania?", "Name Zorbania's capital.", "Capital of Zorbania?",
             "Which city rules Zorbania?", "Tell me Zorbania's capital city.", "Zorbania's capital is?"]
FAST = {"learning_rate": 1e-2, "epochs": 6, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8}


@pytest.fixture
def env(tiny_model, tokenizer, qwen_template, tmp_path):
    engine = StandInEngine(tokenizer=tokenizer, template=qwen_template, model=tiny_model,
                           info=SimpleNamespace(config=tiny_model.config, served_model_id=None, path=None))
    return engine, AdapterStore(tmp_path / "adapters"), TeacherStore(tmp_path / "teachers")


def run(plan_, env) -> TrainJob:
    engine, store, _ = env
    return run_planned(plan_, engine, store)


def saved(env, name: str) -> TrainableLora:
    engine, store, _ = env
    return saved_lora(engine, store, name)


@pytest.fixture
def fact_teacher(env):
    """A local teacher: the base wearing an adapter SFT-trained to answer every question with Quillton."""
    engine, store, teachers = env
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Quillton."}]}
            for q in QUESTIONS]
    body = {"examples": rows, "config": {"learning_rate": 1e-2, "epochs": 5, "lora_rank": 4, "lora_alpha": 8,
                                         "output_name": "fact"}}
    run(plan_sft(parse_model(SftRequest, body), engine, store, None), env)
    register(TeacherRequest(alias="fact-teacher", kind="local", adapter="fact"), engine, store, teachers)
    return "fact-teacher"


def opd(env, body: dict):
    engine, store, teachers = env
    return plan_opd(parse_model(OpdRequest, body), engine, store, None, teachers=teachers)


def greedy(env, lora, messages, n=6) -> list[int]:
    engine = env[0]
    ids = engine.tokenizer.backend.encode(engine.template.render(messages, add_generation_prompt=True),
                                          add_special_tokens=False).ids
    return generate(engine.model, lora, list(ids), max_new_tokens=n, stop_ids=set(engine.tokenizer.eos_token_ids),
                    temperature=0.0, generator=None)


def test_the_top_k_kl_is_zero_at_the_teacher_and_counts_mass_moved_off_its_top_k():
    teacher = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0]]), -1)
    top = teacher.topk(2, -1)
    kl, mass = topk_kl(teacher, top.indices, top.values)
    assert float(kl) == pytest.approx(0.0, abs=1e-6) and float(mass) == pytest.approx(float(top.values.exp().sum()))
    same_odds_elsewhere = torch.log_softmax(torch.tensor([[2.0, 0.0, 5.0, 5.0]]), -1)   # 3:1 kept, mass moved off
    assert float(topk_kl(same_odds_elsewhere, top.indices, top.values)[0]) > 0.5


@pytest.mark.parametrize(("mode", "objective"), [("on_policy", None), ("off_policy", None), ("off_policy", "jsd")])
def test_opd_from_a_fact_teacher_lowers_the_kl_to_it(env, fact_teacher, mode, objective):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chosen = {"objective": objective} if objective else {}
    job = run(opd(env, {"prompts": [{"messages": p} for p in prompts], "teacher": fact_teacher,
                        "config": {**FAST, "training_mode": mode, **chosen, "output_name": "student"}}), env)
    report = job.held_out
    assert report["objective"] == (objective or {"on_policy": "reverse_kl", "off_policy": "forward_kl"}[mode])
    assert report["kl_to_teacher_after"] < 0.5 * report["kl_to_teacher_before"], report
    assert job.loss_curve[-1]["kl_to_teacher"] < job.loss_curve[0]["kl_to_teacher"]


def agreement(env, plan_, lora) -> float:
    """Share of the completions' tokens where the student's most likely next token is the teacher's."""
    logp = _action_logp(env[0].model, lora, plan_.work.items)
    teacher_best = torch.cat([i.top_ids[:, 0] for i in plan_.work.items])
    return float((logp.argmax(-1) == teacher_best).float().mean())


def test_off_policy_opd_makes_the_student_pick_the_fact_teachers_tokens(env, fact_teacher):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plan_ = opd(env, {"prompts": [{"messages": p} for p in prompts], "teacher": fact_teacher,
                      "config": {**FAST, "training_mode": "off_policy", "output_name": "student"}})
    run(plan_, env)
    with torch.no_grad():
        before, after = agreement(env, plan_, None), agreement(env, plan_, saved(env, "student"))
    assert before < 0.2 and after >= 0.7, (before, after)


def test_a_resumed_plan_samples_the_same_completions_and_the_cache_serves_the_teacher(env, fact_teacher):
    body = {"prompts": QUESTIONS[:2], "teacher": fact_teacher,
            "config": {**FAST, "epochs": 1, "samples_per_prompt": 2, "temperature": 1.0, "output_name": "s1"}}
    first = opd(env, body)
    run(first, env)
    again = opd(env, {**body, "config": {**body["config"], "output_name": "s2"}})
    run(again, env)
    assert [i.completion for i in first.work.items] == [i.completion for i in again.work.items]
    assert again.work.cache_hits == len(again.work.items) == 4


def test_self_distillation_moves_the_student_toward_the_teacher_with_privileged_context(env):
    prompts = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Quillton."}]}
               for q in QUESTIONS]
    engine, store, _ = env
    for mode in ("conciseness", "ground_truth_conditioning"):
        plan = plan_self_distill(parse_model(SelfDistillRequest, {
            "prompts": prompts, "mode": mode, "config": {**FAST, "output_name": f"self-{mode}"}}), engine, store, None)
        assert plan.work.items[0].teacher_prompt_ids != plan.work.items[0].prompt_ids
        job = run(plan, env)
        assert job.held_out["kl_to_teacher_after"] < 0.8 * job.held_out["kl_to_teacher_before"], job.held_out


def bad(env, body: dict, self_distill: bool = False) -> KilnError:
    engine, store, teachers = env
    before = sorted(store.root.rglob("*")) if store.root.exists() else []
    with pytest.raises(KilnError) as e:
        if self_distill:
            plan_self_distill(parse_model(SelfDistillRequest, body), engine, store, None)
        else:
            opd(env, body)
    assert (sorted(store.root.rglob("*")) if store.root.exists() else []) == before   # nothing written
    return e.value


def test_an_unknown_teacher_is_a_400(env):
    err = bad(env, {"prompts": ["hi"], "teacher": "nobody"})
    assert (err.status, err.param) == (400, "teacher") and "not registered" in err.message


def test_empty_prompts_are_a_400(env, fact_teacher):
    err = bad(env, {"prompts": [], "teacher": fact_teacher})
    assert (err.status, err.param) == (400, "prompts")


def test_a_prompt_without_a_user_turn_is_a_400_naming_the_row(env, fact_teacher):
    err = bad(env, {"prompts": ["ok", {"messages": [{"role": "system", "content": "x"}]}], "teacher": fact_teacher})
    assert (err.status, err.param) == (400, "prompts[1].messages")


def test_a_remote_teacher_whose_key_is_not_set_is_a_400(env):
    env[2].add({"alias": "far", "kind": "remote", "url": "http://127.0.0.1:9", "api_key_env": "KILN_UNSET_KEY_X",
                "identity": {"model_id": "m"}})
    err = bad(env, {"prompts": ["hi"], "teacher": "far"})
    assert (err.status, err.param) == (400, "teacher") and "KILN_UNSET_KEY_X" in err.message


def test_a_teacher_whose_adapter_changed_is_a_409(env, fact_teacher):
    engine, store, teachers = env
    record = teachers.get(fact_teacher)
    teachers.add({**record, "alias": "stale", "identity": {**record["identity"], "adapter_content_sha256": "x"}})
    err = bad(env, {"prompts": ["hi"], "teacher": "stale"})
    assert (err.status, err.code) == (409, "teacher_changed")


def test_ground_truth_conditioning_without_a_reference_is_a_400(env):
    err = bad(env, {"prompts": ["What is the capital of Zorbania?"], "mode": "ground_truth_conditioning"},
              self_distill=True)
    assert (err.status, err.param) == (400, "prompts[0].reference")


def test_an_interrupted_opd_job_is_planned_again_from_its_kept_request_with_its_teacher(env, fact_teacher):
    from kiln.train.submission import resume_job

    engine, store, teachers = env
    body = {"prompts": QUESTIONS[:2], "teacher": fact_teacher, "config": {**FAST, "output_name": "again"}}
    kept = SimpleNamespace(job_id="train-kept")
    manager = SimpleNamespace(resume_request=lambda job_id: (kept, "opd", body), resume=lambda plan: plan)
    plan_ = resume_job(manager, "train-kept", engine, store, None, None, None, teachers)
    assert (plan_.job_id, plan_.job_type, plan_.adapter_name) == ("train-kept", "opd", "again")
    assert plan_.work.teacher.factors is not None
