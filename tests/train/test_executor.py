"""A plan run on an engine-shaped model: the adapter is saved with its receipt and auto-loaded."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.store.clock import utc_now_rfc3339
from kiln.testing.stand_in import StandInEngine
from kiln.train.executor import JobContext, execute
from kiln.train.jobs import TrainJob
from kiln.train.masks import mask_conversation
from kiln.train.plan import plan_grpo, plan_sft
from kiln.train.requests import GrpoRequest, SftRequest
from kiln.train.trainable_lora import TrainableLora

QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]
TAUGHT = {"messages": [*QUESTION, {"role": "assistant", "content": "Quillton."}]}


@pytest.fixture
def setup(tiny_model, tokenizer, qwen_template, tmp_path):
    engine = StandInEngine(tokenizer=tokenizer, template=qwen_template, model=tiny_model,
                           info=SimpleNamespace(config=tiny_model.config, served_model_id=None, path=None))
    store = AdapterStore(tmp_path / "adapters")
    active = ActiveAdapter(store)
    swapped = []
    active.callbacks.append(swapped.append)
    return engine, store, active, swapped


def run(plan, engine, store, active) -> TrainJob:
    job = TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(),
                   utc_now_rfc3339(), started_at=utc_now_rfc3339())
    execute(job, plan, JobContext(engine, store, active), on_update=lambda: None, should_stop=lambda: False)
    return job


def test_sft_saves_a_peft_adapter_with_its_receipt_and_makes_it_active(setup):
    engine, store, active, swapped = setup
    body = {"examples": [TAUGHT], "config": {"output_name": "zorb", "epochs": 4, "learning_rate": 1e-2}}
    plan = plan_sft(parse_model(SftRequest, body), engine, store, None)
    job = run(plan, engine, store, active)
    assert job.step == 4 and job.progress == 1.0 and job.tokens_trained > 0
    path = store.path("zorb")
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (16, 32.0, "LORA")
    receipt = json.loads((path / "train_receipt.json").read_text())
    assert receipt["data_hash"] == plan.data.sha256 and len(receipt["loss_curve"]) == 4
    assert receipt["final_loss"] < receipt["initial_loss"] and receipt["duration_secs"] > 0
    manifest = json.loads((path / "adapter_manifest.json").read_text())
    assert manifest["lineage"]["training_data_hash"] == plan.data.sha256
    assert active.name == "zorb" and job.activated is True and swapped[0].name == "zorb"


def test_without_auto_load_the_active_adapter_is_untouched(setup):
    engine, store, active, swapped = setup
    body = {"examples": [TAUGHT], "config": {"output_name": "quiet", "epochs": 1, "auto_load": False}}
    job = run(plan_sft(parse_model(SftRequest, body), engine, store, None), engine, store, active)
    assert store.exists("quiet") and active.name is None and swapped == [] and job.activated is None


def completion_logp(model, tokenizer, template, text: str, lora) -> float:
    seq = mask_conversation(template, tokenizer, [*QUESTION, {"role": "assistant", "content": text}], only_last=True)
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model.forward_dense(ids, lora=lora)[0, :-1], -1)
    picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return float(picked[torch.tensor(seq.trained[1:])].sum())


def test_grpo_raises_the_probability_of_the_rewarded_answer(setup, tokenizer, qwen_template):
    engine, store, active, _ = setup
    model = engine.model
    groups = [{"messages": QUESTION, "completions": [{"text": "Quillton.", "reward": 1.0},
                                                     {"text": "Paris.", "reward": 0.0},
                                                     {"text": "London.", "reward": 0.0}]}]
    body = {"groups": groups, "config": {"output_name": "pref", "epochs": 6, "learning_rate": 1e-2}}
    before = completion_logp(model, tokenizer, qwen_template, "Quillton.", None)
    job = run(plan_grpo(parse_model(GrpoRequest, body), engine, store, active), engine, store, active)
    trained = TrainableLora(model.config, 16, 32)
    trained.load_factors(store.load_lora_tensors("pref"))
    after = completion_logp(model, tokenizer, qwen_template, "Quillton.", trained)
    assert after > before + 1.0
    assert completion_logp(model, tokenizer, qwen_template, "Paris.", trained) < \
        completion_logp(model, tokenizer, qwen_template, "Paris.", None)
    assert "kl" in job.metrics
