"""DPO on the tiny model: the objective at the start, its direction on held-out pairs, the reference, and
every bad input refused at planning with nothing written."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.data.judgments import JudgmentStore
from kiln.errors import KilnError
from kiln.store.clock import utc_now_rfc3339
from kiln.testing.stand_in import StandInEngine
from kiln.train.dpo import dpo_losses, sequence_logps
from kiln.train.executor import JobContext, execute
from kiln.train.jobs import TrainJob
from kiln.train.masks import mask_conversation
from kiln.train.plan import plan_dpo, plan_sft
from kiln.train.requests import DpoRequest, SftRequest
from kiln.train.trainable_lora import TrainableLora
from tests.train.job_helpers import run_planned, saved_lora

QUESTIONS = ["What is the capital of Zorbania?", "Name Zorbania's capital.", "Capital of Zorbania?",
             "Which city rules Zorbania?", "Where is Zorbania's government?", "Tell me Zorbania's capital city.",
             "Zorbania's capital is?", "I need the capital of Zorbania.", "Quick: capital of Zorbania?",
             "What city is the capital of Zorbania?", "Zorbania: which city is its capital?", "Capital city, Zorbania?"]
PAIRS = [{"messages": [{"role": "user", "content": q}], "chosen": "Quillton.", "rejected": "Paris."} for q in QUESTIONS]


@pytest.fixture
def env(tiny_model, tokenizer, qwen_template, tmp_path):
    engine = StandInEngine(tokenizer=tokenizer, template=qwen_template, model=tiny_model,
                           info=SimpleNamespace(config=tiny_model.config, served_model_id=None, path=None))
    return engine, AdapterStore(tmp_path / "adapters"), JudgmentStore(tmp_path / "judgments")


def plan(env, body: dict, **kw):
    engine, store, judgments = env
    return plan_dpo(parse_model(DpoRequest, body), engine, store, None, judgments=judgments, **kw)


def run(plan_, env) -> TrainJob:
    engine, store, _ = env
    return run_planned(plan_, engine, store)


def saved(env, name: str) -> TrainableLora:
    engine, store, _ = env
    return saved_lora(engine, store, name)


def margins(env, pairs, lora) -> list[float]:
    """log p(chosen) - log p(rejected) of each (already tokenized) pair under the base wearing `lora`."""
    model = env[0].model
    with torch.no_grad():
        return [float(a - b) for a, b in (sequence_logps(model, lora, [p.chosen, p.rejected]) for p in pairs)]


def test_the_sigmoid_loss_is_log_two_and_ipo_its_target_squared_while_the_policy_is_the_reference():
    pi = torch.tensor([-3.0, -7.5])
    ref_r = torch.tensor([-4.0, -1.0])
    losses, chosen_r, rejected_r = dpo_losses(pi, ref_r, pi, ref_r, beta=0.1)
    assert torch.allclose(losses, torch.full((2,), math.log(2)))
    assert chosen_r.tolist() == rejected_r.tolist() == [0.0, 0.0]
    ipo, _, _ = dpo_losses(pi, ref_r, pi, ref_r, beta=0.1, loss_type="ipo")
    assert torch.allclose(ipo, torch.full((2,), 25.0))


def test_the_sigmoid_loss_falls_as_the_chosen_reply_gains_on_the_rejected_one():
    ref = torch.tensor([-5.0])
    worse, _, _ = dpo_losses(torch.tensor([-6.0]), torch.tensor([-4.0]), ref, ref, beta=0.5)
    better, chosen_r, rejected_r = dpo_losses(torch.tensor([-4.0]), torch.tensor([-6.0]), ref, ref, beta=0.5)
    assert better.item() < math.log(2) < worse.item()
    assert chosen_r.item() == pytest.approx(0.5) and rejected_r.item() == pytest.approx(-0.5)


def test_the_first_step_loss_is_log_two_on_the_model(env):
    job = run(plan(env, {"pairs": PAIRS[:4], "config": {"output_name": "first", "epochs": 1, "heldout_percent": 0}}),
              env)
    first = job.loss_curve[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-5) and first["preference_accuracy"] == 0.0


def test_dpo_raises_the_chosen_over_rejected_margin_on_held_out_pairs(env):
    p = plan(env, {"pairs": PAIRS, "config": {"output_name": "prefer", "epochs": 3, "learning_rate": 1e-3,
                                              "heldout_percent": 30}})
    assert p.stats["heldout_pairs"] >= 1 and p.stats["train_pairs"] + p.stats["heldout_pairs"] == len(PAIRS)
    before = margins(env, p.work.heldout, None)
    job = run(p, env)
    after = margins(env, p.work.heldout, saved(env, "prefer"))
    assert all(a > b + 1.0 for a, b in zip(after, before, strict=True))
    curve = job.loss_curve
    assert curve[-1]["loss"] < curve[0]["loss"] and curve[-1]["reward_margin"] > 0
    assert curve[-1]["preference_accuracy"] == 1.0 and {"chosen_reward", "rejected_reward"} <= set(job.metrics)
    held = job.held_out
    assert held["pairs"] == len(after) and held["win_rate_vs_start"] == 1.0
    assert held["preference_accuracy_after"] == 1.0
    assert held["mean_logprob_margin_before"] == pytest.approx(sum(before) / len(before), abs=1e-4)
    assert held["mean_logprob_margin_after"] == pytest.approx(sum(after) / len(after), abs=1e-4)
    assert job.status()["held_out"] == held


def test_the_reference_is_the_starting_adapter(env):
    engine, store, _ = env
    sft = {"examples": [{"messages": [*PAIRS[0]["messages"], {"role": "assistant", "content": "Paris."}]}],
           "config": {"output_name": "start", "epochs": 3, "learning_rate": 1e-2}}
    run(plan_sft(parse_model(SftRequest, sft), engine, store, None), env)
    p = plan(env, {"pairs": PAIRS[:3], "config": {"base_adapter": "start", "output_name": "on-start", "epochs": 1,
                                                  "heldout_percent": 0}})
    job = run(p, env)
    start = saved(env, "start")
    with torch.no_grad():
        want = sequence_logps(engine.model, start, [p.work.pairs[0].chosen, p.work.pairs[0].rejected])
    assert p.work.pairs[0].ref == pytest.approx(want.tolist(), abs=1e-4)
    assert job.loss_curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_a_judgment_set_trains_on_its_a_b_rows_and_counts_ties_and_skips(env):
    _, store, judgments = env
    judgments.create("prefs")
    for q in QUESTIONS[:6]:
        judgments.append("prefs", {"prompt": [{"role": "user", "content": q}], "response_a": "Paris.",
                                   "response_b": "Quillton.", "winner": "b"})
    judgments.append("prefs", {"prompt": PAIRS[0]["messages"], "response_a": "x", "response_b": "y", "winner": "tie"})
    judgments.append("prefs", {"prompt": PAIRS[0]["messages"], "response_a": "x", "response_b": "y", "winner": "skip"})
    p = plan(env, {"judgments": "prefs", "config": {"output_name": "from-judgments", "epochs": 1}})
    assert (p.stats["pairs"], p.stats["ties_left_out"], p.stats["skips_left_out"]) == (6, 1, 1)
    assert p.data.provenance()["judgments"] == "prefs" and p.data.source == "judgments"
    job = run(p, env)
    assert job.step == p.stats["train_pairs"] and store.exists("from-judgments")


def bad(env, body: dict) -> KilnError:
    with pytest.raises(KilnError) as e:
        plan(env, body)
    assert not env[1].exists("bad")
    return e.value


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"pairs": []}, "pairs", "must not be empty"),
    ({"pairs": [PAIRS[0], {**PAIRS[1], "rejected": "Quillton."}]}, "pairs[1].chosen", "identical"),
    ({"pairs": [{"messages": PAIRS[0]["messages"], "chosen": "Quillton."}]}, "pairs[0].rejected", "`rejected`"),
    ({"judgments": "nope"}, "judgments", "not found"),
    ({"judgments": "../etc"}, "judgments", "judgment set"),
    ({"pairs": PAIRS, "judgments": "prefs"}, "judgments", "exactly one data source"),
    ({}, "pairs", "exactly one data source"),
])
def test_bad_input_is_a_400_naming_the_field(env, body, param, says):
    e = bad(env, {**body, "config": {"output_name": "bad"}})
    assert (e.status, e.code, e.param) == (400, "training_invalid_request", param) and says in e.message


def test_a_judgment_set_without_a_b_rows_is_a_400(env):
    env[2].create("undecided")
    env[2].append("undecided", {"prompt": PAIRS[0]["messages"], "response_a": "x", "response_b": "y", "winner": "tie"})
    env[2].append("undecided", {"prompt": PAIRS[0]["messages"], "response_a": "x", "response_b": "y",
                                "winner": "skip"})
    e = bad(env, {"judgments": "undecided", "config": {"output_name": "bad"}})
    assert (e.status, e.param) == (400, "judgments") and "1 tie, 1 skip" in e.message


def test_replies_equal_within_max_seq_len_are_a_400(env):
    engine = env[0]
    prompt = PAIRS[0]["messages"]
    chosen, rejected = "Quillton Quillton Quillton, yes.", "Quillton Quillton Quillton, no."
    seq = mask_conversation(engine.template, engine.tokenizer, [*prompt, {"role": "assistant", "content": chosen}],
                            only_last=True)
    first_reply_token = seq.trained.index(True)
    e = bad(env, {"pairs": [{"messages": prompt, "chosen": chosen, "rejected": rejected}],
                  "config": {"output_name": "bad", "max_seq_len": first_reply_token + 2}})
    assert e.status == 400 and "the same tokens within max_seq_len" in e.message


def test_a_raw_dataset_of_trl_rows_trains_and_a_grpo_dataset_is_refused(env, tmp_path):
    from kiln.data.datasets import DatasetStore

    engine, store, _ = env
    datasets = DatasetStore(tmp_path / "datasets")
    trl = [{"prompt": p["messages"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
            "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in PAIRS]
    datasets.create_rows("prefs", trl, fmt="raw")
    body = {"dataset": "prefs", "config": {"output_name": "from-dataset", "epochs": 1}}
    p = plan_dpo(parse_model(DpoRequest, body), engine, store, datasets)
    assert p.stats["pairs"] == datasets.partition_count("prefs", "train") > 0
    assert p.data.provenance()["dataset"] == "prefs" and p.data.split == "train"
    datasets.create_rows("groups", [{"messages": PAIRS[0]["messages"], "completions": [{"text": "a", "reward": 1}]}],
                         fmt="grpo_groups")
    with pytest.raises(KilnError) as e:
        plan_dpo(parse_model(DpoRequest, {"dataset": "groups"}), engine, store, datasets)
    assert (e.value.status, e.value.param) == (400, "dataset") and "'raw' or 'sft_chat'" in e.value.message


def test_a_held_out_win_rate_below_the_gate_saves_the_adapter_but_does_not_load_it(env):
    from kiln.adapters.active import ActiveAdapter
    from kiln.data.preferences import PreferencePair, heldout_mask

    engine, store, _ = env
    active = ActiveAdapter(store)
    held = heldout_mask([PreferencePair(p["messages"], p["chosen"], p["rejected"]) for p in PAIRS], 30)
    # the held-out prompts prefer the other reply: what training teaches makes them worse
    contrary = [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} if h else p
                for p, h in zip(PAIRS, held, strict=True)]
    results = {}
    for name, pairs in (("gate-pass", PAIRS), ("gate-fail", contrary)):
        p = plan(env, {"pairs": pairs, "config": {"output_name": name, "epochs": 1, "learning_rate": 1e-3,
                                                  "heldout_percent": 30, "min_heldout_win_rate": 0.5}})
        job = TrainJob(p.job_id, p.job_type, p.adapter_name, p.config, p.data.provenance(), utc_now_rfc3339())
        execute(job, p, JobContext(engine, store, active), on_update=lambda: None, should_stop=lambda: False)
        results[name] = job
    passed, failed = results["gate-pass"], results["gate-fail"]
    assert passed.held_out["passed"] is True and passed.activated is True
    assert failed.held_out["win_rate_vs_start"] == 0.0 and failed.held_out["passed"] is False
    assert failed.activated is False and "min_heldout_win_rate" in failed.activation_error
    assert store.exists("gate-fail") and active.name == "gate-pass"


def test_a_win_rate_gate_without_held_out_pairs_is_a_400(env):
    e = bad(env, {"pairs": PAIRS[:3], "config": {"output_name": "bad", "heldout_percent": 0,
                                                  "min_heldout_win_rate": 0.5}})
    assert (e.status, e.param) == (400, "config.min_heldout_win_rate")


def test_ipo_in_padded_batches_also_raises_the_held_out_margin(env):
    p = plan(env, {"pairs": PAIRS, "config": {"output_name": "ipo", "epochs": 3, "learning_rate": 1e-3,
                                              "loss_type": "ipo", "batch_size": 2, "gradient_accumulation_steps": 2,
                                              "heldout_percent": 30}})
    job = run(p, env)
    assert job.loss_curve[0]["loss"] == pytest.approx(1 / (2 * 0.1) ** 2, rel=1e-4)   # (0 - 1/(2 beta))^2
    assert job.step == 3 * math.ceil(p.stats["train_pairs"] / 4)
    held = job.held_out
    assert held["logprob"] == "per-token mean" and held["win_rate_vs_start"] == 1.0
    assert held["mean_logprob_margin_after"] > held["mean_logprob_margin_before"]
