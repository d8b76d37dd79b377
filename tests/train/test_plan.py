"""Submission-time validation: bad input is a 400 naming the example and the field."""

from __future__ import annotations

import json

import pytest

from kiln.adapters.peft_format import config_dict
from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model
from kiln.data.datasets import DatasetStore
from kiln.errors import KilnError
from kiln.train.errors import CODE, PREFIX
from kiln.train.plan import plan_grpo, plan_sft
from kiln.train.requests import GrpoRequest, SftRequest
from kiln.train.trainable_lora import TrainableLora

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
GROUP = {"messages": [{"role": "user", "content": "2+2?"}],
         "completions": [{"text": "4", "reward": 1.0}, {"text": "5", "reward": 0.0}]}


@pytest.fixture
def adapters(tmp_path) -> AdapterStore:
    return AdapterStore(tmp_path / "adapters")


def sft(body, engine_view, adapters, datasets=None):
    req = parse_model(SftRequest, body, code=CODE, prefix=PREFIX)
    return plan_sft(req, engine_view, adapters, datasets)


def rejected(fn, *args) -> KilnError:
    with pytest.raises(KilnError) as e:
        fn(*args)
    return e.value


def test_inline_examples_plan_with_defaults(engine_view, adapters):
    plan = sft({"examples": [GOOD, GOOD]}, engine_view, adapters)
    assert plan.config["lora_rank"] == 16 and plan.config["lora_alpha"] == 32.0
    assert plan.config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert plan.loop.total_steps(2) == 3 * 2 and plan.auto_load
    assert plan.data.provenance()["source"] == "inline" and plan.data.sha256.startswith("sha256:")
    assert plan.adapter_name.startswith("sft-")


def test_an_example_without_an_assistant_message_names_the_example(engine_view, adapters):
    bad = {"messages": [{"role": "user", "content": "Hi"}]}
    err = rejected(sft, {"examples": [GOOD, bad]}, engine_view, adapters)
    assert (err.status, err.code, err.param) == (400, "training_invalid_request", "examples[1].messages")
    assert "examples[1]" in err.message


def test_a_malformed_message_names_the_example_and_field(engine_view, adapters):
    bad = {"messages": [{"role": 7, "content": "Hi"}]}
    err = rejected(sft, {"examples": [bad]}, engine_view, adapters)
    assert err.param == "examples[0].messages[0].role"


def test_exactly_one_data_source_is_required(engine_view, adapters):
    assert rejected(sft, {}, engine_view, adapters).param == "examples"
    both = rejected(sft, {"examples": [GOOD], "dataset": "qa"}, engine_view, adapters)
    assert both.status == 400 and both.param == "dataset"


def test_unknown_config_keys_are_refused():
    err = rejected(lambda: parse_model(SftRequest, {"examples": [GOOD], "config": {"learnign_rate": 1}}, code=CODE))
    assert err.param == "config.learnign_rate"


def test_no_trained_token_within_max_seq_len_is_a_400(engine_view, adapters):
    err = rejected(sft, {"examples": [GOOD], "config": {"max_seq_len": 8}}, engine_view, adapters)
    assert err.param == "examples[0].messages" and "max_seq_len" in err.message


def test_an_existing_output_adapter_is_a_409_unless_overwrite(engine_view, adapters, tiny_model):
    lora = TrainableLora(tiny_model.config, 4, 8)
    adapters.save_adapter("taken", lora.factors(), config_dict(4, 8))
    err = rejected(sft, {"examples": [GOOD], "config": {"output_name": "taken"}}, engine_view, adapters)
    assert (err.status, err.code) == (409, "adapter_already_exists")
    assert sft({"examples": [GOOD], "config": {"output_name": "taken", "overwrite": True}}, engine_view, adapters)


def test_a_bad_output_name_is_a_400(engine_view, adapters):
    err = rejected(sft, {"examples": [GOOD], "config": {"output_name": "../x"}}, engine_view, adapters)
    assert (err.status, err.code, err.param) == (400, "invalid_adapter_name", "config.output_name")


def test_continuing_from_a_base_adapter_takes_its_shape_and_factors(engine_view, adapters, tiny_model):
    lora = TrainableLora(tiny_model.config, 4, 8, target_modules=["q_proj", "v_proj"])
    adapters.save_adapter("v1", lora.factors(), config_dict(4, 8, ["q_proj", "v_proj"]))
    plan = sft({"examples": [GOOD], "config": {"base_adapter": "v1", "output_name": "v1"}}, engine_view, adapters)
    assert (plan.lora.rank, plan.lora.alpha, plan.lora.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    assert plan.overwrite and plan.lora.base_factors and plan.lora.base_adapter_sha256.startswith("sha256:")
    err = rejected(sft, {"examples": [GOOD], "config": {"base_adapter": "v1", "lora_rank": 8}}, engine_view, adapters)
    assert err.param == "config.lora_rank"
    missing = rejected(sft, {"examples": [GOOD], "config": {"base_adapter": "nope"}}, engine_view, adapters)
    assert (missing.status, missing.param) == (404, "config.base_adapter")


def test_a_named_dataset_split_is_read_with_provenance(engine_view, adapters, tmp_path):
    datasets = DatasetStore(tmp_path / "datasets")
    datasets.create_rows("qa", [GOOD] * 20)
    plan = sft({"dataset": "qa"}, engine_view, adapters, datasets)
    prov = plan.data.provenance()
    assert prov["source"] == "dataset" and prov["dataset"] == "qa" and prov["split"] == "train"
    assert prov["num_rows"] == datasets.partition_count("qa", "train")
    assert prov["dataset_corpus_sha256"]


def test_a_dataset_of_the_wrong_format_is_refused(engine_view, adapters, tmp_path):
    datasets = DatasetStore(tmp_path / "datasets")
    datasets.create_rows("groups", [GROUP] * 10, fmt="grpo_groups")
    err = rejected(sft, {"dataset": "groups"}, engine_view, adapters, datasets)
    assert err.param == "dataset" and "sft_chat" in err.message


def test_a_jsonl_path_names_the_bad_line(engine_view, adapters, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({"messages": []}) + "\n")
    err = rejected(sft, {"dataset_path": str(path)}, engine_view, adapters)
    assert err.param == "dataset_path" and "line 3" in err.message
    assert rejected(sft, {"dataset_path": "data.jsonl"}, engine_view, adapters).param == "dataset_path"


def test_grpo_groups_plan_and_name_bad_completions(engine_view, adapters):
    body = {"groups": [GROUP], "config": {"kl_coeff": 0.05, "clip_epsilon": 0.1}}
    plan = plan_grpo(parse_model(GrpoRequest, body, code=CODE), engine_view, adapters, None)
    assert plan.work.kl_coeff == 0.05 and plan.work.clip_eps == 0.1 and plan.stats["groups"] == 1
    bad = {"groups": [{**GROUP, "completions": [{"text": "4"}, {"text": "5", "reward": 0}]}]}
    err = rejected(plan_grpo, parse_model(GrpoRequest, bad, code=CODE), engine_view, adapters, None)
    assert err.param == "groups[0].completions[0].reward"

