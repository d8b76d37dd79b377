"""The vLLM-compatible routes lm-evaluation-harness uses, in process over a real tiny engine:
/tokenize, /detokenize, /tokenizer_info (root and /compat) and the legacy /compat/v1/completions."""

from __future__ import annotations

import json
import math

import pytest

from tests.api.tiny_server import tiny_server

ROUTERS = ["kiln.api.routers.system", "kiln.api.routers.chat", "kiln.api.routers.completions",
           "kiln.api.routers.metrics", "kiln.api.routers.adapters", "kiln.api.routers.compat"]
URL = "/compat/v1/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("compat-api"), ROUTERS, attach_adapters=True) as served:
        yield served


@pytest.fixture
def client(served):
    return served.client


def encode(client, text: str) -> list[int]:
    r = client.post("/compat/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- tokenizer routes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("base", ["", "/compat"])
def test_tokenizer_info_has_the_special_tokens_and_template(client, base):
    info = client.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "tokenizer_class" in info
    assert "chat_template" in info and info["model_max_length"] == 320


def test_tokenize_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"prompt": "hello there", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 320
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello there"}


def test_tokenize_renders_chat_messages_with_the_served_template(client):
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_special_tokens_in_text_are_single_tokens(client):
    assert len(encode(client, "<|im_end|>")) == 1


def test_detokenize_rejects_ids_outside_the_vocabulary(client):
    r = client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"


def test_tokenize_of_an_unknown_model_is_model_not_found(client):
    r = client.post("/tokenize", json={"prompt": "x", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---- legacy completions ----------------------------------------------------------------------------------

def loglikelihood_request(ids: list[list[int]]) -> dict:
    """What lm-eval's local-completions sends for loglikelihood requests."""
    return {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def test_echo_logprobs_match_the_contract_prompt_scoring(client):
    ids = encode(client, "The quick brown fox jumps")
    body = client.post(URL, json=loglikelihood_request([ids])).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated token
    scored = client.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 0}).json()
    ours = [e[str(t)]["logprob"] for e, t in zip(scored["choices"][0]["prompt_logprobs"][1:], ids[1:], strict=True)]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(ours, abs=1e-5)


def test_top_logprobs_are_dicts_of_token_text_with_the_observed_token(client):
    ids = encode(client, "one two three four")
    lp = client.post(URL, json={**loglikelihood_request([ids]), "logprobs": 3}).json()["choices"][0]["logprobs"]
    scored = client.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 3}).json()
    entries = scored["choices"][0]["prompt_logprobs"][1:]
    for tok, lpv, top, entry in zip(lp["tokens"][1:], lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:],
                                    entries, strict=False):
        # texts that collide share a key (best value kept), so at most K+1 keys
        assert isinstance(top, dict) and 1 <= len(top) <= 4 and top[tok] >= lpv
        assert max(top.values()) == pytest.approx(max(e["logprob"] for e in entry.values()))
        assert all(v <= 0 for v in top.values())
    assert len(entries) == len(ids) - 1
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_greedy_continuation_is_the_top_logprob(client):
    ids = encode(client, "a b c d")
    choice = client.post(URL, json=loglikelihood_request([ids])).json()["choices"][0]
    last_top = choice["logprobs"]["top_logprobs"][-1]
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(max(last_top.values()))


def test_a_list_of_prompts_gets_one_choice_each_in_order(client):
    prompts = [encode(client, "first prompt"), encode(client, "the second, longer prompt here")]
    body = client.post(URL, json=loglikelihood_request(prompts)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [len(p) + 1 for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_max_tokens_zero_with_echo_scores_only_the_prompt(client):
    ids = encode(client, "only the prompt")
    body = client.post(URL, json={**loglikelihood_request([ids]), "max_tokens": 0}).json()
    choice = body["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert choice["text"] == "only the prompt" and body["usage"]["completion_tokens"] == 0


def test_text_prompts_generate_and_stop(client):
    body = client.post(URL, json={"prompt": ["Once upon a time", "Hello"], "max_tokens": 5, "temperature": 0}).json()
    assert len(body["choices"]) == 2
    for c in body["choices"]:
        assert c["logprobs"] is None and c["finish_reason"] in ("length", "stop") and isinstance(c["text"], str)
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"]["completion_tokens"] <= 10


def test_greedy_generation_is_reproducible_and_echo_prefixes_the_prompt(client):
    req = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    a = client.post(URL, json=req).json()["choices"][0]["text"]
    b = client.post(URL, json={**req, "echo": True}).json()["choices"][0]["text"]
    assert b == "Once upon a time" + a


def test_generation_logprobs_cover_only_the_generated_tokens(client):
    body = client.post(URL, json={"prompt": "abc", "max_tokens": 4, "temperature": 0, "logprobs": 2}).json()
    choice = body["choices"][0]
    n = body["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["tokens"]) == n and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert all(math.isfinite(v) for v in choice["logprobs"]["token_logprobs"])


def test_n_gives_n_choices_per_prompt(client):
    body = client.post(URL, json={"prompt": ["x", "y"], "max_tokens": 2, "n": 2, "seed": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("field,value", [("stream", True), ("suffix", "end"), ("logprobs", 21),
                                         ("best_of", 3), ("max_tokens", -1)])
def test_unsupported_or_invalid_fields_are_400s(client, field, value):
    r = client.post(URL, json={"prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_token_ids_outside_the_vocabulary_are_rejected(client):
    r = client.post(URL, json={"prompt": [[1, 2, 10**7]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[0][2]"


def test_an_unknown_model_is_model_not_found(client):
    r = client.post(URL, json={"prompt": "x", "model": "text-davinci-003"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_contract_completions_route_is_unchanged(client):
    r = client.post("/v1/completions", json={"prompt": "x y", "echo": True, "max_tokens": 5, "prompt_logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_vanishing_temperature_is_greedy_not_a_failed_step(client):
    req = {"prompt": "Once upon a time", "max_tokens": 4}
    greedy = client.post(URL, json={**req, "temperature": 0}).json()["choices"][0]["text"]
    tiny = client.post(URL, json={**req, "temperature": 2.4e-163})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy


def test_legacy_completions_pass_the_admission_gate_and_give_their_places_back(served):
    from kiln.core.admission import AdmissionGate

    engine = served.state.engine
    saved = engine.admission
    try:
        engine.admission = AdmissionGate(1, 0)
        held = engine.admission.admit([3])   # one request already waiting fills the gate
        full = served.client.post(URL, json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert full.status_code == 429 and full.json()["error"]["code"] == "inference_queue_full"
        assert full.headers["retry-after"]
        for t in held:
            engine.admission.done(t)
        for body in ({"prompt": "hello", "max_tokens": 2, "temperature": 0},
                     {"prompt": [[5, 6, 7]], "max_tokens": 0, "echo": True, "logprobs": 1}):
            ok = served.client.post(URL, json=body)
            assert ok.status_code == 200, ok.text
            assert engine.admission.waiting == 0 and engine.admission.queued_tokens == 0
    finally:
        engine.admission = saved


# ---- logprobs under an adapter -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter(served):
    """A stored adapter that moves this tiny model's logits well past the test tolerance."""
    from kiln.adapters.compat import model_spec_from_config
    from kiln.adapters.peft_format import DEFAULT_TARGET_MODULES, config_dict
    from tests.adapters.helpers import random_factors

    cfg = served.state.engine.info.config
    factors = random_factors(4, layers=cfg.num_hidden_layers, seed=11, spec=model_spec_from_config(cfg))
    served.state.services.adapter_store.save_adapter("sharp", factors, config_dict(4, 8, list(DEFAULT_TARGET_MODULES)))
    return "sharp"


def test_echo_logprobs_under_an_adapter_are_that_adapters_not_the_base_models(client, adapter):
    ids = encode(client, "The quick brown fox jumps")
    base = client.post(URL, json=loglikelihood_request([ids])).json()["choices"][0]["logprobs"]
    r = client.post(URL, json={**loglikelihood_request([ids]), "model": adapter})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == adapter
    tuned = r.json()["choices"][0]["logprobs"]
    prompt_part = slice(1, len(ids))  # the prompt's own tokens: the same ids on both sides
    gaps = [abs(a - b) for a, b in zip(tuned["token_logprobs"][prompt_part], base["token_logprobs"][prompt_part],
                                       strict=True)]
    assert max(gaps) > 0.05


def test_tokens_generated_under_an_adapter_are_its_own_greedy_top_logprobs(client, adapter):
    req = {"prompt": "a b c d", "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    base = client.post(URL, json=req).json()["choices"][0]
    tuned = client.post(URL, json={**req, "model": adapter}).json()["choices"][0]
    assert tuned["text"] != base["text"]  # the adapter changes the greedy continuation ...
    lp = tuned["logprobs"]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # ... and the scores come from the same adapter: each greedy token is its own top-1
        assert value == pytest.approx(max(top.values()), abs=1e-4) and tok in top


def test_legacy_completions_honour_vllm_structured_outputs(client):
    body = client.post(URL, json={"prompt": ["Colour:", "Another colour:"], "max_tokens": 10, "n": 2, "seed": 1,
                                  "temperature": 1.0, "structured_outputs": {"choice": ["red", "blue"]}}).json()
    assert [c["text"] for c in body["choices"]] and all(c["text"] in ("red", "blue") for c in body["choices"])
    assert all(c["finish_reason"] == "stop" for c in body["choices"])


def test_legacy_completions_refuse_a_grammar_that_does_not_compile_naming_it(client):
    r = client.post(URL, json={"prompt": "x", "guided_regex": "(unclosed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


# ---- chat with logprobs --------------------------------------------------------------------------------

CHAT_URL = "/compat/v1/chat/completions"
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}


def test_compat_chat_logprobs_have_openais_shape_and_greedy_tokens_are_the_top(client):
    body = client.post(CHAT_URL, json={**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    eos = 1 if choice["finish_reason"] == "stop" else 0
    assert len(content) == body["usage"]["completion_tokens"] - eos and content
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode()) and item["logprob"] <= 0
        assert len(item["top_logprobs"]) == 3
        assert item["logprob"] == pytest.approx(item["top_logprobs"][0]["logprob"], abs=1e-5)
    assert "".join(i["token"] for i in content) == choice["message"]["content"]


def test_compat_chat_logprobs_equal_the_contract_prompt_scoring(client):
    # three tokens whose texts are whole tokens of their own (the tiny model's next ones are byte pieces)
    body = client.post(CHAT_URL, json={**CHAT, "max_tokens": 3, "logprobs": True}).json()
    content = body["choices"][0]["logprobs"]["content"]
    prompt = client.post("/compat/tokenize", json={"messages": CHAT["messages"]}).json()["tokens"]
    generated = [encode(client, item["token"]) for item in content]
    assert all(len(g) == 1 for g in generated) and len(generated) == 3
    ids = prompt + [g[0] for g in generated]
    scored = client.post("/v1/completions", json={"prompt": ids, "prompt_logprobs": 0}).json()
    entries = scored["choices"][0]["prompt_logprobs"][len(prompt):]
    assert [i["logprob"] for i in content] == pytest.approx([e[str(t)]["logprob"] for e, t in
                                                             zip(entries, ids[len(prompt):], strict=True)], abs=1e-5)


def test_compat_chat_without_logprobs_says_null(client):
    body = client.post(CHAT_URL, json=CHAT).json()
    assert body["choices"][0]["logprobs"] is None


def streamed_chunks(client, body: dict) -> list[dict]:
    chunks = []
    with client.stream("POST", CHAT_URL, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[6:])["choices"]
    return chunks


def test_streamed_compat_chat_logprobs_equal_the_non_streamed_ones(client):
    # more tokens than one scoring block, so the logprobs arrive in several rounds
    body = {**CHAT, "max_tokens": 40, "logprobs": True, "top_logprobs": 2}
    whole = client.post(CHAT_URL, json=body).json()["choices"][0]["logprobs"]["content"]
    streamed = [item for c in streamed_chunks(client, body) for item in (c.get("logprobs") or {}).get("content") or []]
    assert [i["token"] for i in streamed] == [i["token"] for i in whole] and len(whole) > 16
    # a prefix scored alone agrees with the whole to float rounding
    assert [i["logprob"] for i in streamed] == pytest.approx([i["logprob"] for i in whole], abs=1e-5)
    assert [[t["token"] for t in i["top_logprobs"]] for i in streamed] == \
        [[t["token"] for t in i["top_logprobs"]] for i in whole]


def test_each_streamed_content_chunk_carries_the_logprobs_of_its_own_tokens(client):
    chunks = streamed_chunks(client, {**CHAT, "max_tokens": 40, "logprobs": True})
    content = [c for c in chunks if c.get("delta", {}).get("content")]
    assert len(content) > 16
    for c in content:
        assert "".join(i["token"] for i in c["logprobs"]["content"]) == c["delta"]["content"]


@pytest.mark.parametrize(("extra", "param"), [({"top_logprobs": 2}, "top_logprobs"),
                                              ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_compat_chat_logprobs_rules_name_the_field(client, extra, param):
    r = client.post(CHAT_URL, json={**CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_the_contract_chat_route_keeps_its_closed_shape_when_asked_for_logprobs(client):
    from kiln.testing.schemas import validate

    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3}).json()
    validate("kiln-inference-v1.schema.json", "ChatCompletionResponse", body)
    assert "logprobs" not in body["choices"][0]
