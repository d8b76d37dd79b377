"""`kiln train` builds request bodies from its arguments and files."""

from __future__ import annotations

import json

import pytest

from kiln.cli import build_parser
from kiln.commands.client import ServerError
from kiln.commands.train import build_body


def parse(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_a_local_file_is_sent_inline_with_the_flags_as_config(tmp_path):
    path = tmp_path / "d.jsonl"
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(row) + "\n\n")
    body = build_body(parse("sft", str(path), "-o", "x", "--lr", "0.001", "--epochs", "2", "--no-auto-load",
                            "--target-modules", "q_proj,v_proj"), "examples")
    assert body == {"examples": [row], "config": {"output_name": "x", "learning_rate": 0.001, "epochs": 2,
                                                  "auto_load": False, "target_modules": ["q_proj", "v_proj"]}}


def test_a_dataset_source_and_grpo_options(tmp_path):
    body = build_body(parse("grpo", "--dataset", "g", "--split", "validation", "--kl-coeff", "0.05",
                            "--reward-scorer", '{"kind": "exact_match"}', "--target", "4"), "groups")
    assert body["dataset"] == "g" and body["dataset_split"] == "validation"
    assert body["config"] == {"kl_coeff": 0.05}
    assert body["reward_scorer"] == {"scorer": {"kind": "exact_match"}, "target": "4"}


def test_exactly_one_source_is_required(tmp_path):
    with pytest.raises(ServerError, match="exactly one"):
        build_body(parse("sft"), "examples")
    with pytest.raises(ServerError, match="exactly one"):
        build_body(parse("sft", "--dataset", "a", "--server-path", "/x.jsonl"), "examples")


def test_dpo_takes_a_judgment_set_or_a_pairs_file_and_its_own_options(tmp_path):
    body = build_body(parse("dpo", "--judgments", "prefs", "--beta", "0.2", "--loss-type", "ipo",
                            "--heldout-percent", "20", "--min-heldout-win-rate", "0.6", "-o", "pref"), "pairs")
    assert body == {"judgments": "prefs", "config": {"output_name": "pref", "beta": 0.2, "loss_type": "ipo",
                                                     "heldout_percent": 20, "min_heldout_win_rate": 0.6}}
    path = tmp_path / "p.jsonl"
    row = {"prompt": "Capital of Zorbania?", "chosen": "Quillton.", "rejected": "Paris."}
    path.write_text(json.dumps(row) + "\n")
    assert build_body(parse("dpo", str(path)), "pairs") == {"pairs": [row], "config": {}}
    with pytest.raises(ServerError, match="--judgments"):
        build_body(parse("dpo", str(path), "--judgments", "prefs"), "pairs")


def test_teachers_add_builds_a_local_or_a_remote_registration():
    from kiln.commands.teachers import build_body as teacher_body

    local = build_parser().parse_args(["teachers", "add", "tutor", "--local", "--adapter", "facts"])
    assert teacher_body(local) == {"alias": "tutor", "kind": "local", "adapter": "facts"}
    remote = build_parser().parse_args(["teachers", "add", "big", "--remote", "http://10.0.0.2:8000",
                                        "--model-id", "qwen", "--api-key-env", "BIG_KEY"])
    assert teacher_body(remote) == {"alias": "big", "kind": "remote", "url": "http://10.0.0.2:8000",
                                    "model_id": "qwen", "api_key_env": "BIG_KEY"}


def test_opd_and_distill_self_send_prompts_a_teacher_or_a_mode_and_their_options(tmp_path):
    from kiln.commands.distill import _submit_self
    from kiln.commands.train import _submit_opd

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps("Capital of Zorbania?") + "\n")
    sent = []

    class Client:
        def post(self, route, json):
            sent.append((route, json))
            return {"message": "queued", "job_id": "train-1"}

    args = build_parser().parse_args(["train", "opd", str(path), "--teacher", "tutor", "--mode", "off_policy",
                                      "--objective", "jsd", "--top-k", "32", "--max-new-tokens", "16", "-o", "s1", "--no-follow"])
    assert _submit_opd(Client(), args) == 0
    args = build_parser().parse_args(["distill", "self", str(path), "--mode", "conciseness", "--no-follow"])
    assert _submit_self(Client(), args) == 0
    assert sent == [("/v1/train/opd", {"prompts": ["Capital of Zorbania?"], "teacher": "tutor", "config": {
                        "output_name": "s1", "training_mode": "off_policy", "objective": "jsd", "top_k": 32,
                        "max_new_tokens": 16}}),
                    ("/v1/distill/self", {"prompts": ["Capital of Zorbania?"], "mode": "conciseness", "config": {}})]
