"""Rollout provenance on a real server: every hash in the record is recomputed here from the recorded
inputs (request, response, model files, GET /v1/config), and each sampled action's behavior log-prob
is checked against an independent scoring of the same tokens."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import httpx
import pytest

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

INF = "kiln-inference-v1.schema.json"
pytestmark = pytest.mark.e2e
MSG = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "sea."}]}]
# plain softmax sampling: the post-filter distribution is the model's own, so scoring must agree
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("prov") / "tiny-llama", arch="llama", init_std=0.3)
    srv = start_server(str(model), tmp_path_factory.mktemp("prov-srv"), "--served-model-id", "tiny-prov",
                       "--dtype", "float32")
    srv.model_dir = model
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def rollout(server):
    body = {"messages": MSG, "max_tokens": 12, "seed": 1234, "rollout_provenance": True,
            "include_config_hashes": True, **NEUTRAL}
    validate(INF, "ChatCompletionRequest", body)
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    resp = r.json()
    validate(INF, "ChatCompletionResponse", resp)
    return resp


@pytest.fixture(scope="module")
def record(rollout):
    return rollout["choices"][0]["rollout_provenance"]


def test_prompt_messages_hash_is_recomputed_from_the_request(record):
    core = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sea."}]
    assert record["prompt_messages_sha256"] == sha(json.dumps(core, separators=(",", ":")).encode())


def test_scored_payload_hash_is_recomputed_from_the_response_text(record, rollout):
    payload = {"schema": "kiln.scored-rollout-payload.v1", "text": rollout["choices"][0]["message"]["content"],
               "trajectory": []}
    assert record["scored_payload_sha256"] == sha(json.dumps(payload, separators=(",", ":"),
                                                             ensure_ascii=False).encode())


def test_base_model_hash_is_recomputed_from_the_weight_files(record, server):
    files = [{"name": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
             for f in sorted(server.model_dir.glob("*.safetensors"))]
    assert record["behavior_policy"]["base_model_sha256"] == sha(canonical({"format": "hf-safetensors",
                                                                            "files": files}))


def test_inference_config_hash_is_recomputed_from_the_served_config(record, rollout, server):
    config = httpx.get(server.base_url + "/config", timeout=30).json()
    expected = sha(canonical(config["effective_inference_config"]))
    assert record["behavior_policy"]["inference_config_sha256"] == expected
    assert rollout["metadata"]["config_hashes"]["effective_config_hash"] == expected
    assert record["behavior_policy"]["served_model_id"] == "tiny-prov"


def test_tokenizer_and_template_hashes_are_recomputed_from_the_model_files(record, rollout, server):
    from kiln.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(server.model_dir)
    spec = json.loads(tok.backend.to_str())
    vocab = {"model": spec["model"], "added_tokens": spec["added_tokens"]}
    config = {k: v for k, v in spec.items() if k not in ("model", "added_tokens")}
    config["special_tokens"] = {"bos_token": tok.bos_token, "eos_token": tok.eos_token,
                                "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                                "eos_token_ids": tok.eos_token_ids}
    template = json.loads((server.model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert record["tokenizer"] == {"vocab_sha256": sha(canonical(vocab)), "config_sha256": sha(canonical(config)),
                                   "chat_template_sha256": sha(template.encode())}
    hashes = rollout["metadata"]["config_hashes"]
    assert hashes["tokenizer_config_hash"] == record["tokenizer"]["config_sha256"]
    assert hashes["chat_template_hash"] == hashes["training_chat_template_hash"] == sha(template.encode())


def test_model_config_hash_is_recomputed_from_config_json(rollout, server):
    from kiln.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(json.loads((server.model_dir / "config.json").read_text()))
    assert rollout["metadata"]["config_hashes"]["model_config_hash"] == sha(canonical(dataclasses.asdict(cfg)))


def test_input_tokens_are_the_rendered_prompt_then_every_completion_token(record, rollout, server):
    from kiln.engine.chat_template import ChatTemplate
    from kiln.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(server.model_dir)
    prompt = ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token).render(MSG)
    prompt_ids = tok.encode(prompt)
    n = record["prompt_token_count"]
    assert record["input_token_ids"][:n] == prompt_ids
    assert len(record["input_token_ids"]) - n == rollout["usage"]["completion_tokens"] == len(record["action_tokens"])
    assert [a["sequence_index"] for a in record["action_tokens"]] == list(range(n, len(record["input_token_ids"])))


def test_resolved_sampling_seed_and_backend_are_recorded(record):
    assert record["seed"] == 1234
    assert record["sampling"] == {**NEUTRAL, "max_tokens": 12, "stop": []}
    assert record["generation_backend"] == "kiln-torch-cpu"


def test_behavior_logprobs_match_an_independent_scoring_of_the_tokens(record, server):
    ids = record["input_token_ids"]
    r = httpx.post(server.base_url + "/completions", json={"prompt": ids, "prompt_logprobs": 0}, timeout=120)
    entries = r.json()["choices"][0]["prompt_logprobs"]
    for a in record["action_tokens"]:
        assert a["source"] == "sampled"
        scored = entries[a["sequence_index"]][str(a["token_id"])]["logprob"]
        assert a["behavior_logprob"] == pytest.approx(scored, abs=1e-3)
