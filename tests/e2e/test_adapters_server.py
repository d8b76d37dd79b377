"""LoRA adapters end to end: upload PEFT adapters, select per request, compose, batch them, hot-swap."""

from __future__ import annotations

import asyncio
import io
import tarfile

import httpx
import pytest
import torch

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Tell me about the mountains."}]


def _peft_archive(model_dir, tmp_path, name: str, modules: list[str], seed: int) -> bytes:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=modules))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 2.0)
    out = tmp_path / name
    peft_model.save_pretrained(out)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in out.iterdir():
            tar.add(f, arcname=f.name)
    return buf.getvalue()


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    server = start_server(str(tiny_model_dir), tmp, "--served-model-id", "tiny")
    for name, modules, seed in (("style-x", ["q_proj", "v_proj", "down_proj"], 1),
                                ("style-y", ["o_proj", "gate_proj", "up_proj"], 2)):
        data = _peft_archive(tiny_model_dir, tmp, name, modules, seed)
        r = httpx.post(server.url + "/v1/adapters/upload", data={"name": name},
                       files={"archive": (f"{name}.tar.gz", data, "application/gzip")}, timeout=60)
        assert r.status_code == 200, r.text
    yield server
    stop_server(server)


def chat(server, **fields) -> dict:
    r = httpx.post(server.base_url + "/chat/completions", timeout=120,
                   json={"messages": MSG, "max_tokens": 12, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    validate("kiln-inference-v1.schema.json", "ChatCompletionResponse", r.json())
    return r.json()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_adapter_changes_the_output_and_is_named_in_performance(lora_server):
    base = chat(lora_server, adapter=None)
    x = chat(lora_server, adapter="style-x", include_performance=True)
    assert text(x) != text(base)
    assert x["metadata"]["performance"]["adapter_used"] == "style-x"


def test_unknown_adapter_is_a_404(lora_server):
    r = httpx.post(lora_server.base_url + "/chat/completions", timeout=30,
                   json={"messages": MSG, "adapter": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "adapter_not_found"


def test_adapter_and_adapters_together_are_a_400(lora_server):
    r = httpx.post(lora_server.base_url + "/chat/completions", timeout=30,
                   json={"messages": MSG, "adapter": "style-x", "adapters": [{"name": "style-y", "scale": 1}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_compose_request"


def test_mixed_batch_gives_each_request_the_output_it_gets_alone(lora_server):
    selections = [{"adapter": None}, {"adapter": "style-x"}, {"adapter": "style-y"},
                  {"adapters": [{"name": "style-x", "scale": 1.0}, {"name": "style-y", "scale": 0.5}]}] * 2
    alone = [text(chat(lora_server, **sel)) for sel in selections[:4]]
    assert len(set(alone)) == 4  # base, X, Y and X+Y all differ

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=lora_server.base_url, timeout=120) as client:
            async def one(sel):
                r = await client.post("/chat/completions",
                                      json={"messages": MSG, "max_tokens": 12, "temperature": 0, **sel})
                return r.json()["choices"][0]["message"]["content"]
            return await asyncio.gather(*(one(sel) for sel in selections))

    assert asyncio.run(run_all()) == alone * 2


def test_loaded_adapter_becomes_the_default_and_null_still_means_base(lora_server):
    base = text(chat(lora_server, adapter=None))
    x = text(chat(lora_server, adapter="style-x"))
    r = httpx.post(lora_server.url + "/v1/adapters/load", json={"name": "style-x"}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        assert text(chat(lora_server)) == x
        assert text(chat(lora_server, adapter=None)) == base
        assert text(chat(lora_server, adapter="")) == base
    finally:
        httpx.post(lora_server.url + "/v1/adapters/unload", timeout=30)
    assert text(chat(lora_server)) == base


def test_models_lists_adapters_with_the_base_as_parent(lora_server):
    data = httpx.get(lora_server.base_url + "/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["style-x"]["parent"] == "tiny"
    assert "parent" not in by_id["tiny"]


def test_rollout_provenance_records_the_adapter_identity(lora_server):
    body = chat(lora_server, adapter="style-y", rollout_provenance=True, seed=3)
    policy = body["choices"][0]["rollout_provenance"]["behavior_policy"]
    listed = {a["name"]: a for a in httpx.get(lora_server.url + "/v1/adapters").json()["available"]}
    assert policy["adapter"]["name"] == "style-y"
    assert policy["adapter"]["content_sha256"].startswith("sha256:")
    assert policy["adapter"]["content_sha256"] in str(listed["style-y"])


def test_a_restarted_server_says_ready_only_once_it_serves_the_default_adapter_again(tiny_model_dir, tmp_path):
    # /health answered 200 before the default adapter was restored: a first request could get the base
    # model, and the adapter's state file could be mid-write when a client looked
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny")
    try:
        data = _peft_archive(tiny_model_dir, tmp_path, "style-x", ["q_proj", "v_proj", "down_proj"], 1)
        r = httpx.post(server.url + "/v1/adapters/upload", data={"name": "style-x"},
                       files={"archive": ("style-x.tar.gz", data, "application/gzip")}, timeout=60)
        assert r.status_code == 200, r.text
        x = text(chat(server, adapter="style-x"))
        assert httpx.post(server.url + "/v1/adapters/load", json={"name": "style-x"}, timeout=30).status_code == 200
    finally:
        stop_server(server)
    server = start_server(str(tiny_model_dir), tmp_path, "--served-model-id", "tiny")
    try:
        # start_server returns at the first 200 from /health
        assert httpx.get(server.url + "/health", timeout=30).json()["active_adapter"] == "style-x"
        assert text(chat(server)) == x
    finally:
        stop_server(server)
