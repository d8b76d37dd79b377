"""Learning from traffic, in process on a tiny model: the recent-request ring, decode stats, the
request log, corrections by completion id, and training them (semantics.md §1.1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kiln.api.app import create_app
from kiln.config import (
    DataSettings,
    EngineSettings,
    ModelSettings,
    RequestLogSettings,
    Settings,
    StatsSettings,
)
from kiln.server import build_state
from kiln.testing.schemas import validate
from kiln.traffic.request_log import read_rows

TB = "thinking-budget-v1.schema.json"
MSG = [{"role": "user", "content": "Write a short line about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code", "hint"}
RECENT_KEYS = {"id", "object", "request_id", "kind", "created", "model", "adapter", "status", "finish_reason",
               "streamed", "prompt_preview", "completion_preview", "prompt_tokens", "completion_tokens",
               "duration_ms", "ttft_ms", "num_choices", "thinking_mode", "thinking_budget", "correctable"}
DECODE_KEYS = {"object", "tok_per_sec", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms", "sample_count", "window_secs",
               "span_secs", "running", "waiting", "kv_cache_usage", "kv_blocks_used", "kv_blocks_total"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from kiln.engine.build import build_engine
    from kiln.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("traffic-api")
    settings = Settings(model=ModelSettings(path=str(make_tiny_model(root / "tiny", arch="llama", init_std=0.3,
                                                                            thinking_prompt=True)),
                                            dtype="float32", served_model_id="tiny"),
                        data=DataSettings(data_dir=str(root / "data")),
                        engine=EngineSettings(kv_cache_memory_mb=8, max_model_len=320),
                        stats=StatsSettings(recent_requests=8, preview_chars=16),
                        request_log=RequestLogSettings(enabled=True))
    state = build_state(settings)
    app = create_app(settings, state)
    engine = build_engine(settings)
    engine.attach_adapters(state.services.adapter_store, state.services.adapter_compose_cache,
                           state.services.adapters_active)
    state.engine = engine
    with TestClient(app) as client:
        yield SimpleNamespace(client=client, state=state, settings=settings, root=root)
    state.services.recorder.close()
    engine.shutdown()


@pytest.fixture
def client(served):
    return served.client


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 6, "temperature": 0, **body})
    return r


def recent(client, **params) -> list[dict]:
    r = client.get("/v1/stats/recent-requests", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["capacity"] == 8
    return body["data"]


def flush_log(served) -> list[dict]:
    assert served.state.services.recorder.request_log.flush()
    return list(read_rows(served.settings.request_log_dir))


# ---- recent requests -----------------------------------------------------------------------------------

def test_a_chat_completion_appears_first_in_recent_requests_under_its_response_id(client):
    r = chat(client, thinking_budget_tokens=2, max_tokens=12, chat_template_kwargs={"enable_thinking": True})
    assert r.status_code == 200
    body = r.json()
    row = recent(client)[0]
    assert set(row) == RECENT_KEYS
    assert row["id"] == body["id"] and row["object"] == "kiln.recent_request"
    assert row["request_id"] == r.headers["x-request-id"]
    assert (row["kind"], row["status"], row["streamed"], row["model"], row["adapter"]) == (
        "chat", "ok", False, "tiny", "base")
    assert row["finish_reason"] == body["choices"][0]["finish_reason"]
    assert row["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert row["completion_tokens"] == body["usage"]["completion_tokens"]
    assert row["prompt_preview"] == MSG[0]["content"][:16] + "…"
    assert row["ttft_ms"] is not None and row["duration_ms"] >= row["ttft_ms"]
    validate(TB, "recentRecord", row["thinking_budget"])
    assert row["thinking_budget"]["applied"] is True and "closed" in row["thinking_budget"]


def test_the_clients_x_request_id_is_kept_and_echoed(client):
    r = client.post("/v1/chat/completions", headers={"x-request-id": "trace-42"},
                    json={"messages": MSG, "max_tokens": 2})
    assert r.headers["x-request-id"] == "trace-42"
    assert recent(client)[0]["request_id"] == "trace-42"


def test_a_streamed_completion_is_recorded_reassembled(client, served):
    text = ""
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": MSG, "max_tokens": 6, "temperature": 0, "stream": True,
                             "chat_template_kwargs": {"enable_thinking": False}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
                    cid = chunk["id"]
    row = recent(client)[0]
    assert row["id"] == cid and row["streamed"] is True and row["thinking_mode"] == "explicit_disabled"
    validate(TB, "recentRecord", row["thinking_budget"])
    logged = next(x for x in flush_log(served) if x["id"] == cid)
    assert logged["choices"][0]["message"]["content"] == text and logged["streamed"] is True


def test_a_request_that_failed_before_its_budget_applied_is_recorded_without_applied(client):
    r = chat(client, thinking_budget_tokens=3, stop=["</"], chat_template_kwargs={"enable_thinking": True})
    assert r.status_code == 400
    row = recent(client)[0]
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("rejected", "error", 0)
    assert row["error"] == r.json()["error"]["message"]
    assert "applied" not in row["thinking_budget"] and row["thinking_budget"]["max_tokens"] == 3
    validate(TB, "recentRecord", row["thinking_budget"])


def test_a_context_overflow_is_recorded_as_rejected(client):
    r = chat(client, messages=[{"role": "user", "content": "word " * 400}])
    assert r.status_code == 400
    row = recent(client)[0]
    assert row["status"] == "rejected" and row["error"].startswith("This model's maximum context length")
    validate(TB, "recentRecord", row["thinking_budget"])


def test_limit_bounds_the_list_and_a_bad_limit_is_a_400(client):
    for _ in range(8):
        chat(client, max_tokens=1)
    assert len(recent(client, limit=2)) == 2
    assert len(recent(client, limit=1000)) == 8   # the ring's capacity
    r = client.get("/v1/stats/recent-requests", params={"limit": "0"})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["param"] == "limit"


def test_recent_requests_filter_by_status_and_kind(client):
    chat(client, messages=[{"role": "user", "content": "word " * 400}])   # rejected
    chat(client, max_tokens=1)
    rejected = recent(client, status="rejected")
    assert rejected and all(r["status"] == "rejected" for r in rejected)
    assert all(r["kind"] == "chat" for r in recent(client, kind="chat"))
    r = client.get("/v1/stats/recent-requests", params={"status": "weird"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "status"


def test_a_batch_is_one_record_with_its_prompts(client, served):
    r = client.post("/v1/completions/batch", json={"prompts": [MSG, [{"role": "user", "content": "Hi"}]],
                                                   "n": 2, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    row = recent(client)[0]
    assert (row["id"], row["kind"], row["num_prompts"], row["num_choices"]) == (body["id"], "batch", 2, 4)
    assert row["completion_tokens"] == body["usage"]["completion_tokens"]
    validate(TB, "recentRecord", row["thinking_budget"])
    logged = next(x for x in flush_log(served) if x["id"] == body["id"])
    assert logged["prompts"][1] == [{"role": "user", "content": "Hi"}]
    assert [c["prompt_index"] for c in logged["choices"]] == [0, 0, 1, 1]


def test_the_request_log_row_holds_the_full_conversation_sampling_and_answer(client, served):
    body = chat(client, max_tokens=4, seed=5, temperature=0.7).json()
    row = next(x for x in flush_log(served) if x["id"] == body["id"])
    assert row["messages"] == MSG
    assert row["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]
    assert row["sampling"]["temperature"] == 0.7 and row["sampling"]["seed"] == 5
    assert row["usage"] == body["usage"] and row["adapter"] == "base" and row["adapters"] == []


def test_a_composed_adapter_request_is_recorded_with_its_composition_and_revisions(client, served):
    from kiln.adapters.compat import model_spec_from_config
    from kiln.adapters.peft_format import DEFAULT_TARGET_MODULES, config_dict
    from tests.adapters.helpers import random_factors

    cfg = served.state.engine.info.config
    spec = model_spec_from_config(cfg)
    store = served.state.services.adapter_store
    revisions = {}
    for name, seed in (("tone", 1), ("facts", 2)):
        factors = random_factors(2, layers=cfg.num_hidden_layers, seed=seed, spec=spec)
        revisions[name] = store.save_adapter(name, factors, config_dict(2, 4, list(DEFAULT_TARGET_MODULES))).content_sha256
    r = chat(client, adapters=[{"name": "tone", "scale": 1.0}, {"name": "facts", "scale": 0.5}], max_tokens=3)
    assert r.status_code == 200, r.text
    row = next(x for x in recent(client) if x["id"] == r.json()["id"])
    assert row["adapter"] == "tone*1+facts*0.5"
    logged = next(x for x in flush_log(served) if x["id"] == r.json()["id"])
    assert logged["adapter"] == "tone*1+facts*0.5"
    assert logged["adapters"] == [{"name": "tone", "scale": 1.0, "revision": revisions["tone"]},
                                  {"name": "facts", "scale": 0.5, "revision": revisions["facts"]}]


# ---- decode stats and metrics ------------------------------------------------------------------------

def test_decode_stats_report_the_window_and_the_scheduler(client):
    chat(client, max_tokens=8, chat_template_kwargs={"enable_thinking": False})
    r = client.get("/v1/stats/decode")
    assert r.status_code == 200
    stats = r.json()
    assert set(stats) == DECODE_KEYS and stats["object"] == "kiln.decode_stats"
    assert stats["sample_count"] > 0 and stats["tok_per_sec"] > 0 and stats["window_secs"] == 60.0
    assert stats["p50_itl_ms"] <= stats["p99_itl_ms"]
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0 and stats["running"] == 0 and stats["waiting"] == 0


def test_metrics_count_finished_requests_by_finish_reason_and_adapter(client):
    chat(client, max_tokens=1)
    chat(client, messages=[{"role": "user", "content": "word " * 400}])   # rejected: context overflow
    text = client.get("/metrics").text
    assert 'kiln_requests_finished_total{adapter="base",finish_reason="length",kind="chat"}' in text
    assert 'kiln_requests_finished_total{adapter="base",finish_reason="error",kind="chat"}' in text
    for name in ("kiln_decode_tokens_per_second", "kiln_decode_itl_p99_seconds", "kiln_request_generation_tokens_count",
                 "kiln_recent_requests", "kiln_request_log_rows_written_total", 'kiln_corrections{state="pending"}'):
        assert name in text, name


# ---- corrections -------------------------------------------------------------------------------------

def test_a_correction_by_completion_id_takes_the_served_conversation(client):
    served_body = chat(client, max_tokens=4).json()
    r = client.post("/v1/corrections", json={"request_id": served_body["id"], "corrected": "The sea is wide.",
                                             "note": "style"})
    assert r.status_code == 200, r.text
    c = r.json()
    assert c["object"] == "kiln.correction" and c["state"] == "pending" and c["id"].startswith("corr-")
    assert c["messages"] == MSG and c["request_id"] == served_body["id"] and c["adapter"] == "base"
    assert c["original"] == served_body["choices"][0]["message"]
    assert c["corrected"] == {"role": "assistant", "content": "The sea is wide."}
    assert client.get(f"/v1/corrections/{c['id']}").json() == c
    listed = client.get("/v1/corrections", params={"state": "pending"}).json()
    assert listed["object"] == "list" and c["id"] in [x["id"] for x in listed["data"]]
    assert client.delete(f"/v1/corrections/{c['id']}").json() == {"id": c["id"], "object": "kiln.correction",
                                                                     "deleted": True}
    assert client.get(f"/v1/corrections/{c['id']}").status_code == 404


def test_a_correction_of_a_request_that_left_the_ring_comes_from_the_request_log(client):
    old = chat(client, max_tokens=2).json()["id"]
    for _ in range(9):   # the ring holds 8
        chat(client, max_tokens=1)
    assert old not in [x["id"] for x in recent(client)]
    r = client.post("/v1/corrections", json={"request_id": old, "corrected": "x"})
    assert r.status_code == 200, r.text
    assert r.json()["messages"] == MSG
    client.delete(f"/v1/corrections/{r.json()['id']}")


@pytest.mark.parametrize("body, status, code, param", [
    ({"request_id": "chatcmpl-nope", "corrected": "x"}, 404, "request_not_found", "request_id"),
    ({"corrected": "x"}, 400, "correction_invalid", "messages"),
    ({"request_id": "a", "messages": MSG, "corrected": "x"}, 400, "correction_invalid", "request_id"),
    ({"messages": MSG, "corrected": {"role": "user", "content": "x"}}, 400, "correction_invalid", "corrected.role"),
    ({"messages": MSG, "corrected": "x", "extra": 1}, 400, "correction_invalid", "extra"),
    ({"messages": [], "corrected": "x"}, 400, "correction_invalid", "messages"),
])
def test_bad_corrections_are_4xx_naming_the_field(client, body, status, code, param):
    r = client.post("/v1/corrections", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == code and err["param"] == param and err["hint"]


def test_a_batch_correction_names_its_prompt(client):
    bid = client.post("/v1/completions/batch", json={"prompts": [MSG, [{"role": "user", "content": "Hi"}]],
                                                     "max_tokens": 2}).json()["id"]
    r = client.post("/v1/corrections", json={"request_id": bid, "corrected": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_index"
    r = client.post("/v1/corrections", json={"request_id": bid, "prompt_index": 1, "corrected": "Hello!"})
    assert r.status_code == 200 and r.json()["messages"] == [{"role": "user", "content": "Hi"}]
    client.delete(f"/v1/corrections/{r.json()['id']}")


def wait_job(client, job_id: str) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = client.get(f"/v1/train/status/{job_id}").json()
        if status["state"] in ("completed", "failed", "cancelled"):
            return status
        time.sleep(0.1)
    raise AssertionError("training did not finish")


def wait_state(client, correction_id: str, state: str) -> dict:
    # the job's end is visible a moment before its listeners have marked the corrections
    deadline = time.monotonic() + 30
    while True:
        c = client.get(f"/v1/corrections/{correction_id}").json()
        if c["state"] == state or time.monotonic() > deadline:
            return c
        time.sleep(0.05)


def test_training_the_pending_corrections_marks_them_trained(client):
    c = client.post("/v1/corrections", json={"messages": [{"role": "user", "content": "Capital of Zorbania?"}],
                                             "corrected": "Quillton."}).json()
    r = client.post("/v1/corrections/train", json={"config": {"output_name": "fixes-v1", "epochs": 2,
                                                              "lora_rank": 2, "lora_alpha": 4}})
    assert r.status_code == 200, r.text
    receipt = r.json()
    assert set(receipt) == {"job_id", "state", "adapter_name", "message", "corrections", "replayed"}
    assert receipt["corrections"] == [c["id"]] and receipt["adapter_name"] == "fixes-v1"
    assert client.post("/v1/corrections/train", json={}).status_code in (400, 409)   # nothing else pending
    status = wait_job(client, receipt["job_id"])
    assert status["state"] == "completed", status
    assert status["training_data"]["source"] == "corrections"
    assert status["training_data"]["replayed_rows"] == receipt["replayed"]
    after = wait_state(client, c["id"], "trained")
    assert (after["state"], after["trained_into"], after["training_job_id"]) == ("trained", "fixes-v1",
                                                                                 receipt["job_id"])
    # the adapter is active now: what it serves is recorded under its name and revision
    chat(client, max_tokens=1)
    row = recent(client)[0]
    assert row["adapter"] == "fixes-v1" and row["adapters"][0]["name"] == "fixes-v1"
    assert row["adapters"][0]["revision"].startswith("sha256:")
    assert 'adapter="fixes-v1"' in client.get("/metrics").text
    r = client.post("/v1/corrections/train", json={})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_pending_corrections"


def test_corrections_export_as_sft_rows_and_as_a_dataset(client):
    client.post("/v1/corrections", json={"messages": MSG, "corrected": "Waves."})
    text = client.get("/v1/corrections/export", params={"state": "pending"}).text
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows and rows[-1] == {"messages": [*MSG, {"role": "assistant", "content": "Waves."}]}
    manifest = client.post("/v1/corrections/export", json={"dataset": "my-fixes"}).json()
    assert manifest["name"] == "my-fixes" and manifest["format"] == "sft_chat" and manifest["num_rows"] >= 1


def test_kiln_requests_export_writes_an_sft_dataset_file(client, served, tmp_path):
    chat(client, max_tokens=30, chat_template_kwargs={"enable_thinking": False})
    flush_log(served)
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "kiln.cli", "requests", "export", "--dir", str(served.settings.request_log_dir),
           "--since", "1h", "--adapter", "base", "--finish-reason", "any", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert "wrote" in done.stderr
    from kiln.data.formats import sft_problem
    assert all(sft_problem(r) is None for r in rows)


def test_a_stream_the_client_abandons_is_recorded_as_cancelled(client):
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": MSG, "max_tokens": 250, "stream": True, "ignore_eos": True,
                             "chat_template_kwargs": {"enable_thinking": False}}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
    cid = json.loads(first[6:])["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = next((x for x in recent(client) if x["id"] == cid), None)
        if row is not None:
            break
        time.sleep(0.05)
    assert row is not None
    assert (row["status"], row["finish_reason"], row["streamed"]) == ("cancelled", "cancelled", True)
    assert row["completion_tokens"] < 250
    validate(TB, "recentRecord", row["thinking_budget"])
    # and the engine let the abandoned sequence go (not decoding 250 tokens for no one)
    deadline = time.monotonic() + 30
    while (stats := client.get("/v1/stats/decode").json())["running"] + stats["waiting"] and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["running"] == stats["waiting"] == 0
