"""`model` selects adapters as in vLLM, on a real server started with `--lora-modules` and JSON logs.

The adapter is a PEFT folder saved by PEFT itself and imported at start (`--lora-modules
style-x=PATH`); an `openai` client then selects it with `model="style-x"`, exactly as `adapter` would.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from kiln.testing.schemas import validate

from .conftest import start_server, stop_server

pytestmark = pytest.mark.e2e
MSG = [{"role": "user", "content": "Tell me about the mountains."}]


def _peft_folder(model_dir, out) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 2.0)
    peft_model.save_pretrained(out)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model-select")
    _peft_folder(tiny_model_dir, tmp / "style-x-peft")
    srv = start_server(str(tiny_model_dir), tmp, "--served-model-id", "tiny",
                       "--lora-modules", f"style-x={tmp / 'style-x-peft'}", "--log-format", "json")
    yield srv
    stop_server(srv)


def chat(server, **fields) -> httpx.Response:
    return httpx.post(server.base_url + "/chat/completions", timeout=120,
                      json={"messages": MSG, "max_tokens": 12, "temperature": 0, **fields})


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    validate("kiln-inference-v1.schema.json", "ChatCompletionResponse", resp.json())
    return resp.json()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_lora_modules_are_in_the_store_and_listed_as_models(server):
    names = [a["name"] for a in httpx.get(server.url + "/v1/adapters").json()["available"]]
    assert names == ["style-x"]
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert {"id": "style-x", "parent": "tiny"}.items() <= models[1].items()


def test_model_naming_an_adapter_serves_it_as_adapter_would(server):
    by_model = ok(chat(server, model="style-x"))
    by_field = ok(chat(server, adapter="style-x"))
    base = ok(chat(server))
    assert text(by_model) == text(by_field) != text(base)
    assert by_model["model"] == "style-x" and base["model"] == "tiny"


def test_the_openai_client_selects_the_adapter_by_model(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    resp = client.chat.completions.create(model="style-x", messages=MSG, max_tokens=12, temperature=0)
    assert resp.model == "style-x"
    assert resp.choices[0].message.content == text(ok(chat(server, adapter="style-x")))
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MSG, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"


def test_the_served_id_or_no_model_is_the_base_model(server):
    assert text(ok(chat(server, model="tiny"))) == text(ok(chat(server))) == text(ok(chat(server, model=None)))


def test_an_unknown_model_is_a_404_in_the_error_envelope(server):
    r = chat(server, model="not-a-model")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and err["hint"]


def test_explicit_adapter_fields_win_over_model(server):
    base = text(ok(chat(server)))
    assert text(ok(chat(server, model="style-x", adapter=None))) == base
    assert text(ok(chat(server, model="tiny", adapter="style-x"))) == text(ok(chat(server, adapter="style-x")))


def test_streaming_chunks_name_the_adapter_model(server):
    with httpx.stream("POST", server.base_url + "/chat/completions", timeout=120,
                      json={"messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True,
                            "model": "style-x"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and all(c["model"] == "style-x" for c in chunks)


def test_batch_selects_the_adapter_by_model(server):
    def batch(**fields) -> dict:
        r = httpx.post(server.base_url + "/completions/batch", timeout=120,
                       json={"prompts": [MSG], "max_tokens": 12, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()

    by_model, by_field = batch(model="style-x"), batch(adapter="style-x")
    assert by_model["completions"][0]["text"] == by_field["completions"][0]["text"]
    assert by_model["model"] == "style-x"
    assert httpx.post(server.base_url + "/completions/batch", json={"prompts": [MSG], "model": "nope"}).status_code == 404


def test_legacy_completions_select_the_adapter_by_model(server):
    def complete(model: str) -> str:
        r = httpx.post(server.url + "/compat/v1/completions", timeout=120,
                       json={"model": model, "prompt": "The mountains are", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return r.json()["choices"][0]["text"]

    assert complete("style-x") != complete("tiny")


def test_each_request_has_one_json_access_line_with_its_id_and_generation(server):
    r = chat(server, model="style-x", max_tokens=5)
    rid = r.headers["x-request-id"]
    chat(server, max_tokens=3).raise_for_status()
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x.get("request_id") == rid]
    access = [x for x in mine if x["logger"] == "kiln.access"]
    assert len(access) == 1
    line = access[0]
    assert (line["http_path"], line["http_status"], line["adapter"], line["model"]) == \
        ("/v1/chat/completions", 200, "style-x", "style-x")
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"]
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] and line["ttft_ms"] > 0
    assert line["finish_reason"] == r.json()["choices"][0]["finish_reason"]
    given = httpx.get(server.url + "/v1/models", headers={"x-request-id": "client-chosen-id"})
    assert given.headers["x-request-id"] == "client-chosen-id"


def test_a_legacy_completion_access_line_has_its_tokens_ttft_and_adapter(server):
    r = httpx.post(server.url + "/compat/v1/completions", timeout=120,
                   json={"model": "style-x", "prompt": "The mountains are", "max_tokens": 4, "temperature": 0,
                         "logprobs": 1})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    access = [x for x in (json.loads(line) for line in server.log().splitlines() if line.startswith("{"))
              if x.get("request_id") == rid and x["logger"] == "kiln.access"]
    assert len(access) == 1
    line = access[0]
    assert (line["http_path"], line["adapter"], line["model"]) == ("/compat/v1/completions", "style-x", "style-x")
    assert line["completion_tokens"] == r.json()["usage"]["completion_tokens"] and line["ttft_ms"] > 0
