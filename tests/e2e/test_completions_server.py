"""POST /v1/completions on a real float32 server: prompt log-probs agree with an independent reference
forward (transformers) within 1e-4, and ranks and top-K follow that reference."""

from __future__ import annotations

import httpx
import pytest
import torch

from .conftest import start_server, stop_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def f32_server(tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("cmpl") / "tiny-qwen2", arch="qwen2", init_std=0.3)
    srv = start_server(str(model), tmp_path_factory.mktemp("cmpl-srv"), "--served-model-id", "tiny-f32",
                       "--dtype", "float32")
    srv.model_dir = model
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reference(f32_server):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(f32_server.model_dir), torch_dtype=torch.float32)
    model.eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1)
    return log_softmax


def score(server, **body) -> dict:
    r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_match_a_reference_log_softmax(f32_server, reference):
    ids = [17, 250, 3, 399, 41, 512, 77, 8, 300, 61]
    entries = score(f32_server, prompt=ids, prompt_logprobs=4)["choices"][0]["prompt_logprobs"]
    ref = reference(ids)
    assert entries[0] is None
    for p in range(1, len(ids)):
        row = ref[p - 1]
        entry = entries[p]
        assert entry[str(ids[p])]["logprob"] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        top = row.topk(4).indices.tolist()
        for rank, tid in enumerate(top, 1):
            assert entry[str(tid)]["rank"] == rank
            assert entry[str(tid)]["logprob"] == pytest.approx(row[tid].item(), abs=1e-4)
        if ids[p] not in top:
            assert entry[str(ids[p])]["rank"] == int((row >= row[ids[p]]).sum())


def test_text_prompt_is_tokenized_like_the_tokenizer_does(f32_server):
    from kiln.engine.tokenizer import Tokenizer

    text = "The sea is calm today."
    tok = Tokenizer.from_hf_dir(f32_server.model_dir)
    body = score(f32_server, prompt=text, prompt_logprobs=0)
    assert body["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=True))
    decoded = "".join(next(iter(e.values()))["decoded_token"] for e in body["choices"][0]["prompt_logprobs"][1:])
    first = tok.decode(tok.encode(text, add_special_tokens=True)[:1])
    assert first + decoded == tok.decode(tok.encode(text, add_special_tokens=True))


def test_system_fingerprint_is_the_base_model_identity(f32_server):
    body = score(f32_server, prompt="x y", prompt_logprobs=1)
    config = httpx.get(f32_server.base_url + "/config", timeout=30).json()
    assert body["system_fingerprint"] == config["model"]["base_model_sha256"]
    assert body["model"] == "tiny-f32"
