"""kiln.example.toml is honest: every key in it (commented ones included) loads, every settings field is
in it, and every setting changes something a user can observe.

Adding a setting: put it in kiln.example.toml and add one row to OBSERVED below: (a value other than
the example's, a probe that reads what the setting changes, cheaply).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kiln.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "kiln.example.toml"
_LINE = re.compile(r"^(?:#\s*)?([a-z_]+)\s*=\s*(.+?)\s*(?:#.*)?$")


def example_entries() -> list[tuple[str, str, Any]]:
    """(section, key, value) for every `key = value` line, commented-out ones included."""
    out, section = [], None
    for raw in EXAMPLE.read_text().splitlines():
        line = raw.strip()
        if m := re.fullmatch(r"\[([a-z_]+)\]", line):
            section = m.group(1)
            continue
        m = _LINE.match(line)
        if m and section is not None:
            out.append((section, m.group(1), tomllib.loads(f"v = {m.group(2)}")["v"]))
    return out


ENTRIES = example_entries()


def settings_fields() -> set[tuple[str, str]]:
    # `replicas` is a list of tables, not a section: tests/replicas covers it
    return {(sec.name, f.name) for sec in dataclasses.fields(Settings) if sec.name != "replicas"
            for f in dataclasses.fields(getattr(Settings(), sec.name))}


def with_value(tmp_path: Path, section: str, key: str, value: Any) -> Settings:
    rendered = _toml_value(value)
    path = tmp_path / f"{section}-{key}.toml"
    path.write_text(f"[{section}]\n{key} = {rendered}\n")
    s = load_settings(path, env={})
    if section != "data":
        s.data.data_dir = str(tmp_path / "data")  # whatever a probe writes stays in the test's folder
    return s


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


# ---- probes: what each setting changes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kiln.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("settings") / "tiny", arch="llama")


def _light_engine(tiny: Path):
    """The real Engine facade over the tiny model's tokenizer and template, with no weights or actor."""
    from kiln.engine.chat_template import ChatTemplate
    from kiln.engine.grammar import GrammarCounters
    from kiln.engine.serving import Engine, ModelInfo
    from kiln.engine.tokenizer import Tokenizer
    from kiln.model.config import ModelConfig

    tok = Tokenizer.from_hf_dir(tiny)
    cfg = ModelConfig.from_hf_dict(__import__("json").loads((tiny / "config.json").read_text()))
    info = ModelInfo(str(tiny), "tiny", cfg, "hf", "float32", "cpu", 256, 16, 16, 0, {})
    return Engine(info, tok, ChatTemplate(tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token),
                  SimpleNamespace(runner=SimpleNamespace(backend="kiln-torch-cpu", grammar_counters=GrammarCounters())),
                  None)


def _prepared(s: Settings, tiny: Path):
    from kiln.engine.chat_request import ChatInput, prepare_chat

    inp = ChatInput(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": True},
                    budget_fields={})
    return prepare_chat(_light_engine(tiny).prompt_context(), inp, s.server)


def _effective(s: Settings, tiny: Path) -> dict[str, Any]:
    from kiln.engine.serving import effective_inference_config

    return effective_inference_config(s, _light_engine(tiny).info, "kiln-torch-cpu")


def _state(s: Settings):
    from kiln.server import build_state

    return build_state(s)


def _uvicorn(s: Settings):
    from kiln.commands.serve import uvicorn_config

    return uvicorn_config(s, app=None)


def _scoring_timeout(s: Settings) -> str:
    from kiln.engine.score_request import score_prompt
    from kiln.errors import KilnError

    class Slow:
        async def score(self, ids, k):
            await asyncio.sleep(0.2)
            raise RuntimeError("scored")

    try:
        asyncio.run(score_prompt(Slow(), [1, 2], 0, s.server.request_timeout_secs))  # type: ignore[arg-type]
    except KilnError as e:
        return e.message
    except RuntimeError as e:
        return str(e)
    return "unreachable"


def _stalls(s: Settings) -> float:
    from kiln.api.metrics import KilnMetrics
    from kiln.engine.chat_response import FinishedCompletion
    from kiln.engine.timing import RequestTimeline, TokenRecord

    timeline = RequestTimeline(0.0)
    timeline.tokens = [TokenRecord(i, 1, t, t, t, None, 0.0) for i, t in enumerate((0.0, 1.5, 6.0))]
    metrics = KilnMetrics(_state(s))
    metrics.completion_started()
    metrics.completion_finished(FinishedCompletion("chat", "r", "m", "base", True, "ok", 0.0, 6.0, 1,
                                                   timeline=timeline))
    return metrics.stream_stalls._value.get()


def _device(s: Settings) -> str:
    from kiln.engine.build import resolve_device

    try:
        return str(resolve_device(s.model.device))
    except ValueError as e:
        return str(e)


def _kv(s: Settings, tiny: Path) -> tuple[int, int, int]:
    from kiln.engine.build import kv_layout

    return kv_layout(s, _light_engine(tiny).info.config, torch.float32)


def _served_id(s: Settings) -> str:
    from kiln.engine.build import _served_id, model_path

    return _served_id(model_path(s), s.model.served_model_id)


def _model_path(s: Settings) -> str:
    from kiln.engine.build import model_path

    return str(model_path(s))


def _quantization(s: Settings, tiny: Path) -> str:
    """What the engine loads the weights as: build_engine up to load_model, with the setting."""
    import pytest

    from kiln.engine import build

    seen: dict[str, str] = {}

    class Loaded(Exception):
        pass

    def load_model(path, dtype, device, quantization, **_):
        seen["quantization"] = quantization
        raise Loaded

    s.model.path = str(tiny)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "load_model", load_model)
        with contextlib.suppress(Loaded):
            build.build_engine(s, start=False)
    return seen["quantization"]


def _dtype(s: Settings) -> torch.dtype:
    from kiln.model.loader import resolve_dtype

    return resolve_dtype(s.model.dtype)


def _threads(s: Settings) -> int:
    from kiln.engine.build import torch_threads

    return torch_threads(s, env={})


def _cpu_isa(s: Settings) -> str:
    from kiln.model import kernels

    with kernels.using_isa(s.engine.cpu_isa) as isa:   # what build_engine selects, then restored
        return isa


def _eval_jobs(s: Settings):
    return _state(s).services.eval_jobs


def _training(s: Settings):
    return _state(s).services.training


def _datasets_root(s: Settings) -> str:
    return str(_state(s).services.datasets.root)


def _adapters_root(s: Settings) -> str:
    return str(_state(s).services.adapter_store.root)


def _recorder(s: Settings):
    return _state(s).services.recorder


def _request_log(s: Settings, attr: str) -> Any:
    """The request log the server would open (enabled for the probe), one attribute of it."""
    s.request_log.enabled = True
    rlog = _recorder(s).request_log
    try:
        return getattr(rlog, attr) if attr != "queue_rows" else rlog._queue.maxsize
    finally:
        rlog.close()


def _request_log_enabled(s: Settings) -> bool:
    rlog = _recorder(s).request_log
    if rlog is not None:
        rlog.close()
    return rlog is not None


def _decode_window(s: Settings) -> float:
    from kiln.engine.build import decode_window

    return decode_window(s).window_secs


def _log_formatter(s: Settings) -> str:
    from kiln.api.access_log import formatter_for

    return type(formatter_for(s.server.log_format)).__name__


def _access_log(s: Settings) -> bool:
    from kiln.api.app import create_app

    app = create_app(s, _state(s))
    return [m.kwargs for m in app.user_middleware if m.cls.__name__ == "RequestIdMiddleware"][0]["access_log"]


def _outside_lora_path(s: Settings) -> int:
    from fastapi.testclient import TestClient

    from kiln.api.app import create_app

    client = TestClient(create_app(s, _state(s)))
    return client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"}).status_code


def _lora_modules(s: Settings) -> str:
    from kiln.adapters.importing import import_lora_modules
    from kiln.errors import KilnError

    try:
        return repr(import_lora_modules(_state(s).services.adapter_store, s.model.lora_modules))
    except KilnError as e:
        return e.code


def _gate(s: Settings):
    from kiln.engine.build import admission_gate

    return admission_gate(s, kv_pool_tokens=4096, max_model_len=256)


def _keys(s: Settings) -> list[str] | str:
    from kiln.api.auth import load_api_keys
    from kiln.config import ConfigError

    try:
        return load_api_keys(s)
    except ConfigError as e:
        return str(e)


def _metrics_status(s: Settings) -> int:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kiln.api.auth import install_auth

    s.server.api_keys, s.server.api_key_file = "k", None
    app = FastAPI()
    app.get("/metrics")(lambda: {})
    install_auth(app, s)
    return TestClient(app).get("/metrics").status_code


# (section, key) -> (another value, probe(settings, tiny model dir) -> what the setting changes)
OBSERVED: dict[tuple[str, str], tuple[Any, Any]] = {
    ("server", "host"): ("0.0.0.0", lambda s, t: _uvicorn(s).host),
    ("server", "port"): (9001, lambda s, t: _uvicorn(s).port),
    ("server", "log_level"): ("debug", lambda s, t: _uvicorn(s).log_level),
    ("server", "request_timeout_secs"): (0.05, lambda s, t: _scoring_timeout(s)),
    ("server", "eval_mode"): (True, lambda s, t: _prepared(s, t).params[0].temperature),
    ("server", "default_thinking_enabled"): (False, lambda s, t: _prepared(s, t).default_thinking_enabled),
    ("server", "default_thinking_budget_tokens"): (64, lambda s, t: _prepared(s, t).budget.max_tokens),
    ("server", "default_thinking_budget_ms"): (500, lambda s, t: _prepared(s, t).budget.max_time_ms),
    ("server", "fold_reasoning_into_content"): (True, lambda s, t: _prepared(s, t).fold),
    ("server", "chat_performance_metadata"): (True, lambda s, t: _prepared(s, t).include_performance),
    ("server", "chat_config_hash_metadata"): (True, lambda s, t: _prepared(s, t).include_config_hashes),
    ("server", "stream_stall_grace_ms"): (1000.0, lambda s, t: _stalls(s)),
    ("server", "log_format"): ("json", lambda s, t: _log_formatter(s)),
    ("server", "access_log"): (False, lambda s, t: _access_log(s)),
    ("server", "allow_external_lora_paths"): (True, lambda s, t: _outside_lora_path(s)),
    ("model", "lora_modules"): (["x=/no/such/adapter"], lambda s, t: _lora_modules(s)),
    ("server", "api_keys"): ("sk-other", lambda s, t: _keys(s)),
    ("server", "api_key_file"): ("/nonexistent/keys", lambda s, t: _keys(s)),
    ("server", "protect_metrics"): (True, lambda s, t: _metrics_status(s)),
    ("server", "shutdown_timeout_secs"): (5.0, lambda s, t: _state(s).lifecycle.timeout),
    ("model", "path"): ("/models/elsewhere", lambda s, t: _model_path(s)),
    ("model", "served_model_id"): ("another-id", lambda s, t: _served_id(s)),
    ("model", "dtype"): ("float16", lambda s, t: _dtype(s)),
    ("model", "device"): ("cuda" if not torch.cuda.is_available() else "cpu", lambda s, t: _device(s)),
    ("model", "quantization"): ("q8_0", lambda s, t: _quantization(s, t)),
    ("engine", "block_size"): (32, lambda s, t: _kv(s, t)),
    ("engine", "kv_cache_memory_mb"): (1, lambda s, t: _kv(s, t)),
    ("engine", "max_model_len"): (64, lambda s, t: _kv(s, t)),
    ("engine", "max_num_seqs"): (2, lambda s, t: _effective(s, t)["engine"]["max_num_seqs"]),
    ("engine", "max_batch_tokens"): (128, lambda s, t: _effective(s, t)["engine"]["max_batch_tokens"]),
    ("engine", "prefill_cost_with_decodes"): (0, lambda s, t: _effective(s, t)["engine"]["prefill_cost_with_decodes"]),
    ("engine", "itl_target_ms"): (120, lambda s, t: _effective(s, t)["engine"]["itl_target_ms"]),
    ("engine", "enable_prefix_caching"): (False, lambda s, t: _effective(s, t)["engine"]["enable_prefix_caching"]),
    ("engine", "num_threads"): (3, lambda s, t: _threads(s)),
    ("engine", "cpu_isa"): ("scalar", lambda s, t: _cpu_isa(s)),
    ("engine", "max_waiting_requests"): (10, lambda s, t: _gate(s).max_waiting_requests),
    ("engine", "max_queued_prompt_tokens"): (100, lambda s, t: _gate(s).max_queued_tokens),
    ("data", "data_dir"): ("./elsewhere", lambda s, t: _datasets_root(s)),
    ("data", "adapter_dir"): ("./my-adapters", lambda s, t: _adapters_root(s)),
    ("eval", "max_queued_jobs"): (3, lambda s, t: _eval_jobs(s).max_queued_jobs),
    ("eval", "max_tracked_jobs"): (5, lambda s, t: _eval_jobs(s).max_tracked_jobs),
    ("training", "max_queued_jobs"): (3, lambda s, t: _training(s).max_queued_jobs),
    ("training", "max_tracked_jobs"): (5, lambda s, t: _training(s).max_tracked_jobs),
    ("training", "webhook_url"): ("http://127.0.0.1:9/other", lambda s, t: _training(s).webhook_url),
    ("stats", "recent_requests"): (7, lambda s, t: _recorder(s).ring.capacity),
    ("stats", "preview_chars"): (5, lambda s, t: _recorder(s).ring.preview_chars),
    ("stats", "decode_window_secs"): (5.0, lambda s, t: _decode_window(s)),
    ("request_log", "enabled"): (True, lambda s, t: _request_log_enabled(s)),
    ("request_log", "dir"): ("./other-log", lambda s, t: str(_request_log(s, "root"))),
    ("request_log", "max_file_bytes"): (4096, lambda s, t: _request_log(s, "max_file_bytes")),
    ("request_log", "max_total_bytes"): (1000, lambda s, t: _request_log(s, "max_total_bytes")),
    ("request_log", "compress"): (False, lambda s, t: _request_log(s, "compress")),
    ("request_log", "max_capture_bytes"): (1000, lambda s, t: _request_log(s, "max_row_bytes")),
    ("request_log", "queue_rows"): (8, lambda s, t: _request_log(s, "queue_rows")),
    ("training", "checkpoint_every_steps"): (5, lambda s, t: _training(s).checkpoint_every),
    ("training", "auto_resume"): (True, lambda s, t: _training(s).auto_resume),
}


def test_every_settings_field_is_in_the_example_file():
    assert settings_fields() - {(sec, key) for sec, key, _ in ENTRIES} == set()


def test_the_example_file_names_only_real_settings_each_once():
    keys = [(sec, key) for sec, key, _ in ENTRIES]
    assert len(keys) == len(set(keys))
    assert set(keys) <= settings_fields()


@pytest.mark.parametrize(("section", "key", "value"), ENTRIES, ids=[f"{s}.{k}" for s, k, _ in ENTRIES])
def test_every_example_key_loads_with_its_example_value(tmp_path, section, key, value):
    s = with_value(tmp_path, section, key, value)
    assert getattr(getattr(s, section), key) == value


def test_every_setting_has_an_observation():
    assert settings_fields() - set(OBSERVED) == set()


@pytest.mark.parametrize(("section", "key", "value"), ENTRIES, ids=[f"{s}.{k}" for s, k, _ in ENTRIES])
def test_every_example_key_changes_something_observable(tmp_path, monkeypatch, tiny, section, key, value):
    monkeypatch.chdir(tmp_path)
    other, probe = OBSERVED[(section, key)]
    assert other != value
    assert probe(with_value(tmp_path, section, key, value), tiny) != probe(with_value(tmp_path, section, key, other),
                                                                            tiny)
