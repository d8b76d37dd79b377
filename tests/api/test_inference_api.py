"""The inference contract in process: chat, batch and prompt-scoring routes over a real tiny engine.

One engine serves the whole module (TestClient, no subprocess). Each test is one rule of
inference-api.txt / semantics.md §4-6, §13; every 400 must name the offending field in `param`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kiln.store.atomic import canonical_json
from kiln.store.hashing import sha256_tagged
from kiln.testing.schemas import validate
from tests.api.tiny_server import tiny_server

INF = "kiln-inference-v1.schema.json"
MSG = [{"role": "user", "content": "Write a short line about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code", "hint"}
ROUTERS = ["kiln.api.routers.system", "kiln.api.routers.chat", "kiln.api.routers.completions",
           "kiln.api.routers.batch", "kiln.api.routers.metrics"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("inference-api"), ROUTERS) as served:
        yield served


@pytest.fixture
def client(served):
    return served.client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MSG, **body})


def assert_error(resp, status: int, code: str, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == ERROR_KEYS
    assert err["code"] == code, err
    assert err["param"] == param, err
    assert err["message"] and err["hint"]
    return err


def sse(client, body: dict) -> list:
    events = []
    with client.stream("POST", "/v1/chat/completions", json={"messages": MSG, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- chat request rules -------------------------------------------------------------------------------

@pytest.mark.parametrize("entrypoint", ["ChatCompletionRequest", "BatchCompletionRequest", "TextCompletionRequest"])
def test_wire_model_has_exactly_the_contract_fields(entrypoint):
    from kiln.api.wire.batch import BatchCompletionRequest
    from kiln.api.wire.chat import ChatCompletionRequest
    from kiln.api.wire.completions import TextCompletionRequest
    from kiln.testing.schemas import _schemas

    model = {"ChatCompletionRequest": ChatCompletionRequest, "BatchCompletionRequest": BatchCompletionRequest,
             "TextCompletionRequest": TextCompletionRequest}[entrypoint]
    contract = _schemas()[INF]["$defs"][entrypoint]["properties"]
    assert set(model.model_fields) == set(contract)


def test_n_above_64_is_rejected_naming_n(client):
    assert_error(chat(client, n=65), 400, "chat_invalid_request", "n")


def test_n_above_one_with_stream_is_rejected_naming_n(client):
    assert_error(chat(client, n=2, stream=True), 400, "chat_invalid_request", "n")


def test_adapter_with_adapters_array_is_invalid_compose_request(client):
    r = chat(client, adapter=None, adapters=[{"name": "a", "scale": 1}])
    assert_error(r, 400, "invalid_compose_request", "adapters")


def test_named_adapter_is_adapter_not_found(client):
    assert_error(chat(client, adapter="math"), 404, "adapter_not_found", "adapter")


def test_composed_adapter_is_adapter_not_found(client):
    assert_error(chat(client, adapters=[{"name": "style", "scale": 0.5}]), 404, "adapter_not_found",
                 "adapters[0].name")


def test_empty_adapters_list_is_rejected(client):
    assert_error(chat(client, adapters=[]), 400, "invalid_compose_request", "adapters")


def test_adapter_name_with_traversal_is_rejected(client):
    assert_error(chat(client, adapter="../x"), 400, "invalid_adapter_name", "adapter")


@pytest.mark.parametrize("adapter", [None, ""])
def test_null_or_empty_adapter_selects_the_base_model(client, adapter):
    r = chat(client, adapter=adapter, max_tokens=2)
    assert r.status_code == 200, r.text


def test_number_too_large_for_a_double_is_rejected_naming_the_field(client):
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}], '
                    b'"temperature": 1e999}')
    assert_error(r, 400, "chat_invalid_request", "temperature")


@pytest.mark.parametrize("body,kind", [(b"[]", "an array"), (b'"hi"', "a string"), (b"null", "null")])
def test_a_body_that_is_not_an_object_is_rejected_saying_so(client, body, kind):
    r = client.post("/v1/chat/completions", content=body)
    assert_error(r, 400, "chat_invalid_request", None)
    assert r.json()["error"]["message"].endswith(f"the request body must be a JSON object, not {kind}")


def test_nan_literal_is_rejected(client):
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}')
    assert r.status_code == 400


def test_adapter_scale_must_be_finite(client):
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "x"}], '
                    b'"adapters": [{"name": "a", "scale": 1e999}]}')
    assert_error(r, 400, "chat_invalid_request", "adapters[0].scale")


def test_negative_temperature_is_rejected_naming_temperature(client):
    assert_error(chat(client, temperature=-1), 400, "chat_invalid_request", "temperature")


def test_max_tokens_wins_over_max_completion_tokens(client):
    body = chat(client, max_tokens=3, max_completion_tokens=7, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 3


def test_max_completion_tokens_applies_when_max_tokens_is_null(client):
    body = chat(client, max_tokens=None, max_completion_tokens=5, ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 5


def test_prompt_at_the_context_ceiling_is_context_length_exceeded(client):
    long = [{"role": "user", "content": "word " * 400}]
    r = client.post("/v1/chat/completions", json={"messages": long})
    err = assert_error(r, 400, "context_length_exceeded", "messages")
    assert "maximum context length is 320" in err["message"]


def test_max_tokens_is_clamped_to_the_room_left(client):
    messages = [{"role": "user", "content": "word " * 80}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1000, "ignore_eos": True,
                                                     "temperature": 0}).json()
    assert body["usage"]["total_tokens"] == 320


@pytest.mark.parametrize(("field", "value", "param"), [
    ("stream", True, "stream"),
    ("n", 2, "n"),
    ("ignore_eos", True, "ignore_eos"),
    ("max_tokens", 0, "max_tokens"),
    ("max_completion_tokens", 0, "max_completion_tokens"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tools"),
    ("tool_choice", "auto", "tool_choice"),
])
def test_rollout_provenance_preconditions_name_the_field(client, field, value, param):
    assert_error(chat(client, rollout_provenance=True, **{field: value}), 400, "chat_invalid_request", param)


def test_unknown_fields_are_ignored(client):
    assert chat(client, max_tokens=1, logit_bias={"1": 2}, user="u").status_code == 200


# ---- chat metadata ----------------------------------------------------------------------------------

def test_config_hashes_are_absent_unless_requested(client):
    assert "config_hashes" not in chat(client, max_tokens=1).json()["metadata"]


def test_include_config_hashes_adds_the_five_hashes(client, served):
    meta = chat(client, max_tokens=1, include_config_hashes=True).json()["metadata"]
    assert set(meta["config_hashes"]) == {"tokenizer_config_hash", "chat_template_hash", "training_chat_template_hash",
                                          "model_config_hash", "effective_config_hash"}
    config = client.get("/v1/config").json()
    assert meta["config_hashes"]["effective_config_hash"] == config["effective_config_hash"]


def test_server_default_turns_config_hashes_on(client, served):
    served.settings.server.chat_config_hash_metadata = True
    try:
        assert "config_hashes" in chat(client, max_tokens=1).json()["metadata"]
        assert "config_hashes" not in chat(client, max_tokens=1, include_config_hashes=False).json()["metadata"]
    finally:
        served.settings.server.chat_config_hash_metadata = False


def test_performance_reports_measured_phases_and_nulls_the_rest(client):
    body = chat(client, max_tokens=6, ignore_eos=True, include_performance=True).json()
    validate(INF, "ChatCompletionResponse", body)
    perf = body["metadata"]["performance"]
    assert perf["completion_tokens"] == 6 and perf["adapter_used"] == "base"
    assert perf["prefill_ms"] > 0 and perf["decode_ms"] > 0 and perf["ttft_ms"] > 0
    assert perf["resident_prefill_used"] is None
    lat = perf["latency"]
    assert lat["emitted_tokens"] == 6 and lat["gap_samples"] == 5 and lat["retained_gap_samples"] == 5
    assert lat["itl_ms_p50"] <= lat["itl_ms_p99"] <= lat["max_itl_ms"]
    phases = lat["phases"]
    for unmeasured in ("gpu_lock_wait_ms", "graph_capture_ms", "graph_replay_ms", "synchronization_ms",
                       "resize_ms", "trim_ms", "adapter_ms", "training_ms"):
        assert phases[unmeasured] is None
    for measured in ("actor_queue_ms", "tokenization_ms", "prefill_ms", "decode_ms", "sampling_ms", "readback_ms"):
        assert phases[measured] is not None


def test_stream_with_include_performance_times_every_token(client):
    events = sse(client, {"max_tokens": 5, "ignore_eos": True, "include_performance": True})
    timings = [e for e in events if isinstance(e, dict) and e.get("object") == "kiln.token_timing"]
    assert [t["token_index"] for t in timings] == list(range(5))
    for t in timings:
        validate(INF, "StreamingTokenTiming", t)
        assert t["ready_ms"] <= t["producer_delivered_ms"] <= t["handler_received_ms"] <= t["body_enqueued_ms"]
    terminal = next(e for e in events if isinstance(e, dict) and e.get("choices") and "finish_reason" in e["choices"][0])
    assert terminal["metadata"]["performance"]["latency"]["emitted_tokens"] == 5


def test_stream_without_include_performance_has_no_timing_events(client):
    events = sse(client, {"max_tokens": 3})
    assert not any(isinstance(e, dict) and e.get("object") == "kiln.token_timing" for e in events)


def test_chat_responses_carry_the_adapter_and_eval_mode_headers(client):
    r = chat(client, max_tokens=1)
    assert r.headers["x-kiln-eval-mode"] == "false"
    assert r.headers["x-kiln-active-adapter"] == "base"
    assert r.headers["x-kiln-loaded-adapter-revision"] == "base"


def test_rollout_provenance_has_one_action_per_completion_token(client):
    body = chat(client, max_tokens=6, seed=11, rollout_provenance=True).json()
    validate(INF, "ChatCompletionResponse", body)
    record = body["choices"][0]["rollout_provenance"]
    n = body["usage"]["completion_tokens"]
    assert len(record["action_tokens"]) == n
    assert record["seed"] == 11
    ids = record["input_token_ids"]
    for a in record["action_tokens"]:
        assert ids[a["sequence_index"]] == a["token_id"] and a["source"] == "sampled"


# ---- prompt scoring ---------------------------------------------------------------------------------

def score(client, **body):
    return client.post("/v1/completions", json={"prompt": "hello there, sea", "prompt_logprobs": 2, **body})


def test_scoring_returns_null_then_one_map_per_prompt_token(client):
    body = score(client).json()
    validate(INF, "TextCompletionResponse", body)
    lps = body["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and len(lps) == body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 0 and body["choices"][0]["text"] == ""
    assert all(2 <= len(e) <= 3 for e in lps[1:])


def test_scoring_with_k_zero_returns_only_the_observed_token(client):
    ids = [5, 40, 41, 300]
    lps = score(client, prompt=ids, prompt_logprobs=0).json()["choices"][0]["prompt_logprobs"]
    assert [list(e) for e in lps[1:]] == [[str(t)] for t in ids[1:]]


def test_system_fingerprint_is_the_base_model_identity(client):
    body = score(client).json()
    assert body["system_fingerprint"] == client.get("/v1/config").json()["model"]["base_model_sha256"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt_logprobs": 257}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 2}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"stream": True}, "stream"),
    ({"model": "other"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 10**9]}, "prompt[1]"),
])
def test_scoring_request_violations_name_the_field(client, extra, param):
    assert_error(score(client, **extra), 400, "completion_invalid_request", param)


@pytest.mark.parametrize("max_tokens", [None, 0, 1])
def test_scoring_accepts_max_tokens_null_zero_or_one(client, max_tokens):
    assert score(client, max_tokens=max_tokens).status_code == 200


def test_scoring_caps_returned_candidates(client):
    r = score(client, prompt=list(range(1, 301)), prompt_logprobs=256)
    assert_error(r, 400, "completion_invalid_request", "prompt_logprobs")


def test_scoring_refuses_while_an_adapter_is_active(client, served):
    served.state.services.adapters_active = SimpleNamespace(name="style", revision="sha256:x")
    try:
        assert_error(score(client), 400, "completion_invalid_request", "model")
    finally:
        served.state.services.adapters_active = None


# ---- batch ---------------------------------------------------------------------------------------------

def batch(client, **body):
    return client.post("/v1/completions/batch", json={"prompts": [MSG], **body})


def test_batch_over_64_outputs_is_batch_too_large(client):
    r = client.post("/v1/completions/batch", json={"prompts": [MSG] * 33, "n": 2})
    err = assert_error(r, 400, "batch_too_large", "n")
    assert "66 completions" in err["message"]


def test_batch_n_zero_is_rejected_naming_n(client):
    assert_error(batch(client, n=0), 400, "batch_invalid_request", "n")


def test_batch_without_prompts_is_rejected(client):
    r = client.post("/v1/completions/batch", json={"prompts": []})
    assert_error(r, 400, "batch_invalid_request", "prompts")


def test_batch_adapter_string_with_adapters_is_invalid_compose_request(client):
    assert_error(batch(client, adapter="a", adapters=[{"name": "b", "scale": 1}]), 400, "invalid_compose_request",
                 "adapters")


def test_batch_adapter_null_with_adapters_selects_the_composition(client):
    assert_error(batch(client, adapter=None, adapters=[{"name": "b", "scale": 1}]), 404, "adapter_not_found",
                 "adapters[0].name")


def test_batch_items_are_in_prompt_then_completion_order_with_summed_usage(client):
    prompts = [MSG, [{"role": "user", "content": "Another one."}]]
    body = client.post("/v1/completions/batch", json={"prompts": prompts, "n": 3, "max_tokens": 3, "seed": 2}).json()
    validate(INF, "BatchCompletionResponse", body)
    order = [(c["prompt_index"], c["completion_index"]) for c in body["completions"]]
    assert order == [(p, c) for p in range(2) for c in range(3)]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(c["usage"][key] for c in body["completions"])


def test_batch_choice_p_c_uses_seed_plus_p_times_n_plus_c(client):
    prompts = [MSG, [{"role": "user", "content": "Another one."}]]
    body = client.post("/v1/completions/batch", json={"prompts": prompts, "n": 2, "max_tokens": 8, "seed": 40,
                                                      "temperature": 1.0}).json()
    for item in body["completions"]:
        p, c = item["prompt_index"], item["completion_index"]
        solo = client.post("/v1/chat/completions", json={"messages": prompts[p], "max_tokens": 8,
                                                         "seed": 40 + p * 2 + c, "temperature": 1.0}).json()
        assert item["text"] == solo["choices"][0]["message"]["content"]


def test_batch_prompt_that_cannot_run_fails_alone(client):
    prompts = [MSG, [{"role": "user", "content": "word " * 400}]]
    body = client.post("/v1/completions/batch", json={"prompts": prompts, "max_tokens": 2}).json()
    validate(INF, "BatchCompletionResponse", body)
    first, second = body["completions"]
    assert first["finish_reason"] in ("stop", "length")
    assert second["finish_reason"] == "error" and second["text"] == ""


def test_batch_max_tokens_zero_gives_empty_length_items(client):
    body = batch(client, max_tokens=0, n=2).json()
    assert [(c["text"], c["finish_reason"], c["usage"]["completion_tokens"]) for c in body["completions"]] == \
        [("", "length", 0)] * 2


def test_batch_metadata_carries_the_request_wide_budget_configuration(client):
    meta = batch(client, max_tokens=1, thinking_budget_tokens=5).json()["metadata"]
    assert meta == {"thinking_budget": {"configured": True, "max_tokens": 5, "tokens_source": "request",
                                        "time_source": "unlimited"}}


# ---- operator surfaces ----------------------------------------------------------------------------------

def test_health_reports_scheduler_memory_and_checks(client):
    for path in ("/health", "/v1/health"):
        body = client.get(path).json()
        assert body["status"] == "ok"
        assert set(body["scheduler"]) == {"waiting", "running", "blocks_used", "blocks_free", "blocks_total"}
        assert body["scheduler"]["blocks_used"] + body["scheduler"]["blocks_free"] == body["scheduler"]["blocks_total"]
        assert set(body["gpu_memory"]) == {"total_vram_gb", "model_gb", "kv_cache_gb", "training_budget_gb",
                                           "inference_memory_fraction"}
        assert {c["name"] for c in body["checks"]} == {"model_loaded", "scheduler_responsive",
                                                       "inference_prewarm_complete"}
        assert body["model"] == "tiny (2L, 4H, 2KV)" and body["backend"]


def test_config_shows_thinking_defaults_and_resolved_default_sampling(client):
    body = client.get("/v1/config").json()
    assert body["thinking_budget"] == {"default_thinking_budget_tokens": None, "default_thinking_budget_ms": None}
    # a llama model without generation_config sampling fields: OpenAI's neutral defaults (§0)
    assert body["default_sampling"]["temperature"] == 1.0 and body["default_sampling"]["top_k"] == 0
    assert body["effective_config_hash"] == sha256_tagged(canonical_json(body["effective_inference_config"]))


def test_metrics_expose_request_engine_and_budget_series(client):
    chat(client, max_tokens=2)
    text = client.get("/metrics").text
    for name in ("kiln_requests_total", "kiln_request_duration_seconds_bucket", "kiln_request_ttft_seconds",
                 "kiln_request_itl_seconds", "kiln_request_prefill_duration_seconds",
                 "kiln_request_decode_duration_seconds", "kiln_request_queue_duration_seconds",
                 "kiln_scheduler_waiting", "kiln_blocks_used", "kiln_blocks_total", "kiln_kv_cache_usage_ratio",
                 "kiln_tokens_generated_total", "kiln_prefix_cache_lookups_total", "kiln_active_requests",
                 "kiln_thinking_budget_source_total", "kiln_thinking_budget_outcomes_total"):
        assert name in text, name
    assert 'kiln_thinking_budget_outcomes_total{outcome="unconfigured"}' in text


def test_rejected_requests_are_counted_as_rejected(client):
    def rejected() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith('kiln_requests_total{status="rejected"}'):
                return float(line.split()[-1])
        return 0.0

    before = rejected()
    chat(client, n=0)
    assert rejected() == before + 1
