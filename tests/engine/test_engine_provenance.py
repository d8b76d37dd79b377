"""Content identities and the rollout-provenance record (kiln.engine.provenance, semantics.md §6)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

import kiln.engine.provenance as prov
from kiln.core.sampling import SamplingParams
from kiln.engine.provenance import (
    PolicyIdentity,
    ServingIdentity,
    base_model_sha256,
    prompt_messages_sha256,
    provenance_problems,
    rollout_provenance,
    scored_payload_sha256,
)
from kiln.engine.serving import Engine
from kiln.testing.schemas import validate

INF = "kiln-inference-v1.schema.json"
H = "sha256:" + "0" * 64


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def weights(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model-00002.safetensors").write_bytes(b"second shard")
    (d / "model-00001.safetensors").write_bytes(b"first shard")
    (d / "config.json").write_text("{}")
    return d


def expected_identity(d) -> str:
    files = [{"name": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": f.stat().st_size}
             for f in sorted(d.glob("*.safetensors"))]
    manifest = {"format": "hf-safetensors", "files": files}
    return sha(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def test_base_model_identity_is_the_canonical_hash_of_the_weight_files(weights, tmp_path):
    assert base_model_sha256(weights, tmp_path / "data") == expected_identity(weights)


def test_identity_is_cached_beside_the_weights_and_reused(weights, tmp_path, monkeypatch):
    first = base_model_sha256(weights, tmp_path / "data")
    assert (weights / ".kiln-weights-identity.json").is_file()
    monkeypatch.setattr(prov, "sha256_file", lambda _: pytest.fail("the cache should have answered"))
    assert base_model_sha256(weights, tmp_path / "data") == first


def test_changed_weights_invalidate_the_cache(weights, tmp_path):
    base_model_sha256(weights, tmp_path / "data")
    shard = weights / "model-00001.safetensors"
    shard.write_bytes(b"retrained shard")
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert base_model_sha256(weights, tmp_path / "data") == expected_identity(weights)


def test_read_only_weights_cache_under_the_data_dir(tmp_path, monkeypatch):
    gguf = tmp_path / "site-packages" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF weights")
    real_write = prov.atomic_write_json

    def write(path, obj, **kw):
        if "site-packages" in str(path):
            raise PermissionError("read-only")
        real_write(path, obj, **kw)

    monkeypatch.setattr(prov, "atomic_write_json", write)
    digest = base_model_sha256(gguf, tmp_path / "data")
    manifest = {"format": "gguf", "files": [{"name": "model.gguf", "sha256": hashlib.sha256(b"GGUF weights")
                                              .hexdigest(), "size": 12}]}
    assert digest == sha(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    assert list((tmp_path / "data" / "cache" / "weights-identity").glob("*.json"))


def test_prompt_messages_hash_joins_text_parts_in_struct_order():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                             {"type": "input_text", "text": "b"}], "name": "n"}]
    expected = sha(b'[{"role":"user","content":"ab","name":"n"}]')
    assert prompt_messages_sha256(messages) == expected


def test_scored_payload_hash_covers_schema_text_and_an_empty_trajectory():
    assert scored_payload_sha256("hé") == sha(
        '{"schema":"kiln.scored-rollout-payload.v1","text":"hé","trajectory":[]}'.encode())


def record(**over):
    identity = ServingIdentity(H, H, H, H, H)
    args = dict(policy=PolicyIdentity("tiny", identity, H, "kiln-torch-cpu"), prompt_ids=[1, 2, 3],
                token_ids=[7, 90, 91], logprobs=[-0.5, None, None], forced=[False, True, True],
                messages=[{"role": "user", "content": "hi"}], response_text="x", template_kwargs={},
                params=SamplingParams(temperature=0.7, max_tokens=8, seed=5), stops=[],
                budget_limits={"max_tokens": 1}, close_ids=[90, 91])
    args.update(over)
    return rollout_provenance(**args)


def test_record_is_schema_valid_with_forced_close_tokens():
    rec = record()
    validate(INF, "RolloutProvenanceV1", rec)
    assert provenance_problems(rec) == []
    assert [a["source"] for a in rec["action_tokens"]] == ["sampled", "forced", "forced"]
    assert rec["sampling"]["thinking_budget"] == {"max_tokens": 1, "close_token_ids": [90, 91]}


def test_all_forced_actions_are_a_problem():
    rec = record(token_ids=[90, 91], logprobs=[None, None], forced=[True, True])
    assert any("sampled" in p for p in provenance_problems(rec))


def test_forced_token_outside_the_close_sequence_is_a_problem():
    rec = record(token_ids=[7, 8], logprobs=[-0.1, None], forced=[False, True])
    assert any("close sequence" in p for p in provenance_problems(rec))


def test_identity_text_with_surrounding_space_is_a_problem():
    rec = record()
    rec["behavior_policy"]["served_model_id"] = " tiny"
    assert any("served_model_id" in p for p in provenance_problems(rec))


def test_an_identity_still_being_computed_is_waited_for_and_its_error_reaches_every_reader():
    pending: Future = Future()
    actor = SimpleNamespace(runner=SimpleNamespace(backend="fake"))
    eng = Engine(SimpleNamespace(served_model_id="tiny"), SimpleNamespace(), SimpleNamespace(), actor, None,  # type: ignore[arg-type]
                 pending)
    identity = ServingIdentity(H, H, H, H, H)
    threading.Timer(0.05, pending.set_result, args=(identity,)).start()
    assert eng.identity is identity and eng.policy().identity is identity   # waited for the thread
    failed: Future = Future()
    failed.set_exception(OSError("unreadable"))
    eng.identity = None
    assert eng.policy() is None
    broken = Engine(SimpleNamespace(), SimpleNamespace(), SimpleNamespace(), actor, None, failed)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(OSError, match="unreadable"):
            broken.config_hashes()
