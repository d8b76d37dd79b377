"""Resumable training: a job stopped at a checkpoint -- by a pause (graceful shutdown) or a
crash after one -- continues to exactly the adapter an uninterrupted run with the same seed produces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.store.clock import utc_now_rfc3339
from kiln.testing.stand_in import StandInEngine
from kiln.train.checkpoint import CheckpointStore
from kiln.train.distill_plan import plan_self_distill
from kiln.train.executor import Checkpointing, JobContext, execute
from kiln.train.jobs import TrainJob
from kiln.train.loop import Paused
from kiln.train.plan import plan_dpo, plan_grpo, plan_sft
from kiln.train.requests import DpoRequest, GrpoRequest, SelfDistillRequest, SftRequest

QUESTION = [{"role": "user", "content": "What is the capital of Zorbania?"}]
SFT_ROWS = [
    {"messages": [*QUESTION, {"role": "assistant", "content": "Quillton."}]},
    {"messages": [{"role": "user", "content": "Name Zorbania's capital."},
                  {"role": "assistant", "content": "It is Quillton."}]},
    {"messages": [{"role": "user", "content": "Capital of Zorbania?"}, {"role": "assistant", "content": "Quillton"}]},
]
GRPO_GROUPS = [
    {"messages": QUESTION, "completions": [{"text": "Quillton.", "reward": 1.0}, {"text": "Paris.", "reward": 0.0}]},
    {"messages": [{"role": "user", "content": "Say yes."}],
     "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.2}, {"text": "maybe", "reward": 0.5}]},
]

DPO_PAIRS = [
    {"messages": QUESTION, "chosen": "Quillton.", "rejected": "Paris."},
    {"messages": [{"role": "user", "content": "Name Zorbania's capital."}], "chosen": "Quillton.", "rejected": "Rome."},
    {"messages": [{"role": "user", "content": "Say yes."}], "chosen": "yes", "rejected": "no"},
]


class Crash(Exception):
    """Stands in for the process dying: nothing after it runs, the checkpoint files stay as they were."""


@pytest.fixture
def env(tiny_model, tokenizer, qwen_template, tmp_path):
    engine = StandInEngine(tokenizer=tokenizer, template=qwen_template, model=tiny_model,
                           info=SimpleNamespace(config=tiny_model.config, served_model_id=None, path=None))
    return engine, AdapterStore(tmp_path / "adapters"), CheckpointStore(tmp_path / "ckpt")


def make_plan(kind: str, name: str, engine, store):
    if kind == "sft":
        body = {"examples": SFT_ROWS, "config": {"output_name": name, "epochs": 4, "learning_rate": 5e-3, "seed": 7}}
        return plan_sft(parse_model(SftRequest, body), engine, store, None, job_id="train-" + name)
    if kind == "dpo":
        body = {"pairs": DPO_PAIRS, "config": {"output_name": name, "epochs": 3, "learning_rate": 5e-3, "seed": 7,
                                               "heldout_percent": 0}}
        return plan_dpo(parse_model(DpoRequest, body), engine, store, None, job_id="train-" + name)
    if kind == "distill":   # sampled completions: a resume must draw the same ones again
        body = {"prompts": [r["messages"][0]["content"] for r in SFT_ROWS], "mode": "conciseness",
                "config": {"output_name": name, "epochs": 3, "learning_rate": 5e-3, "seed": 7, "max_new_tokens": 4,
                           "samples_per_prompt": 2, "temperature": 1.0}}
        return plan_self_distill(parse_model(SelfDistillRequest, body), engine, store, None, job_id="train-" + name)
    body = {"groups": GRPO_GROUPS, "config": {"output_name": name, "epochs": 5, "learning_rate": 5e-3, "seed": 7,
                                              "updates_per_step": 2}}
    return plan_grpo(parse_model(GrpoRequest, body), engine, store, None, job_id="train-" + name)


def run(plan, engine, store, job: TrainJob | None = None, **kw) -> TrainJob:
    job = job or TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(),
                          utc_now_rfc3339(), started_at=utc_now_rfc3339())
    execute(job, plan, JobContext(engine, store, None), on_update=kw.pop("on_update", lambda: None),
            should_stop=lambda: False, **kw)
    return job


def weights(store: AdapterStore, name: str) -> dict[str, torch.Tensor]:
    return load_file(store.path(name) / "adapter_model.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["sft", "grpo", "dpo", "distill"])
def test_a_job_paused_at_a_batch_boundary_resumes_to_the_uninterrupted_adapter_bit_for_bit(env, kind):
    engine, store, ckpts = env
    straight = run(make_plan(kind, "straight", engine, store), engine, store)

    plan = make_plan(kind, "paused", engine, store)
    job = TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(), utc_now_rfc3339())
    with pytest.raises(Paused):
        run(plan, engine, store, job, checkpointing=Checkpointing(ckpts, 0, lambda: job.step >= 5))
    assert job.checkpoint["step"] == job.step >= 5 and not store.exists("paused")
    paused_at = job.step
    resumed = run(make_plan(kind, "paused", engine, store), engine, store, job,
                  checkpointing=Checkpointing(ckpts, 0))
    assert resumed.resumed_from_step == paused_at and resumed.step == straight.step == straight.total_steps
    assert_bitwise_equal(weights(store, "straight"), weights(store, "paused"))
    assert [p["loss"] for p in resumed.loss_curve] == [p["loss"] for p in straight.loss_curve]


def test_after_a_crash_the_job_continues_from_its_last_periodic_checkpoint(env):
    engine, store, ckpts = env
    run(make_plan("sft", "straight", engine, store), engine, store)
    plan = make_plan("sft", "crashed", engine, store)
    job = TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(), utc_now_rfc3339())

    def die_at_step_7() -> None:
        if job.step == 7:
            raise Crash()

    with pytest.raises(Crash):
        run(plan, engine, store, job, checkpointing=Checkpointing(ckpts, 3), on_update=die_at_step_7)
    assert ckpts.load_state(job.job_id).loop.step == 6   # every 3 steps: 3, 6; step 7 was lost
    fresh = TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(),
                     utc_now_rfc3339())
    resumed = run(make_plan("sft", "crashed", engine, store), engine, store, fresh,
                  checkpointing=Checkpointing(ckpts, 3))
    assert resumed.resumed_from_step == 6
    assert_bitwise_equal(weights(store, "straight"), weights(store, "crashed"))


def test_an_unreadable_checkpoint_means_starting_over_not_failing(env, tmp_path):
    engine, store, ckpts = env
    plan = make_plan("sft", "torn", engine, store)
    ckpts.dir(plan.job_id).mkdir(parents=True)
    (ckpts.dir(plan.job_id) / "state.pt").write_bytes(b"not a checkpoint")
    job = run(plan, engine, store, checkpointing=Checkpointing(ckpts, 0))
    assert job.resumed_from_step is None and job.step == job.total_steps and store.exists("torn")


def test_a_resumed_job_without_a_checkpoint_starts_over_and_forgets_the_lost_progress(env):
    engine, store, ckpts = env
    plan = make_plan("sft", "again", engine, store)
    job = TrainJob(plan.job_id, plan.job_type, plan.adapter_name, plan.config, plan.data.provenance(), utc_now_rfc3339(),
                   step=3, tokens_trained=99, loss_curve=[{"step": s, "loss": 1.0} for s in (1, 2, 3)])
    run(plan, engine, store, job, checkpointing=Checkpointing(ckpts, 0))
    assert job.step == job.total_steps == len(job.loss_curve)
    assert [p["step"] for p in job.loss_curve] == list(range(1, job.total_steps + 1))
