"""`kiln serve [MODEL]` with vLLM-style engine flags, and `--lora-modules NAME=PATH` at start."""

from __future__ import annotations

import argparse
import gc
import threading
import time
from types import SimpleNamespace

import pytest

from kiln.adapters.importing import import_lora_modules
from kiln.adapters.store import AdapterStore
from kiln.commands import serve
from kiln.config import ConfigError, load_settings
from kiln.errors import KilnError
from tests.adapters.helpers import save_random


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kiln")
    serve.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def settings_for(*argv: str):
    return load_settings(None, serve._overrides(parse(*argv)), env={})


def test_the_model_is_positional_as_in_vllm_serve():
    assert settings_for("/models/qwen").model.path == "/models/qwen"
    assert settings_for("--model", "/models/qwen").model.path == "/models/qwen"


def test_engine_flags_use_vllms_names():
    s = settings_for("m", "--max-num-seqs", "8", "--max-model-len", "1024", "--kv-cache-memory-mb", "128",
                     "--block-size", "32", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching",
                     "--num-threads", "2", "--served-model-name", "my-model", "--device", "cpu")
    e = s.engine
    assert (e.max_num_seqs, e.max_model_len, e.kv_cache_memory_mb, e.block_size, e.max_batch_tokens) == \
        (8, 1024, 128, 32, 256)
    assert e.enable_prefix_caching is False and e.num_threads == 2
    assert s.model.served_model_id == "my-model" and s.model.device == "cpu"


def test_unset_flags_leave_the_file_and_defaults_alone():
    s = settings_for()
    assert s.engine.enable_prefix_caching is True and s.server.access_log is True and s.model.path is None


def test_log_flags():
    s = settings_for("--log-format", "json", "--no-access-log")
    assert s.server.log_format == "json" and s.server.access_log is False


def test_lora_modules_flag_and_environment():
    s = settings_for("--lora-modules", "a=/x/a", "b=/x/b")
    assert s.model.lora_modules == ["a=/x/a", "b=/x/b"]
    env = load_settings(None, env={"KILN_MODEL_LORA_MODULES": "a=/x/a, b=/x/b"})
    assert env.model.lora_modules == ["a=/x/a", "b=/x/b"]
    with pytest.raises(ConfigError, match="NAME=PATH"):
        load_settings(None, env={"KILN_MODEL_LORA_MODULES": "nopath"})


def test_lora_modules_are_imported_into_the_store(tmp_path):
    src = AdapterStore(tmp_path / "elsewhere")
    save_random(src, "trained", r=2, alpha=4, modules=["q_proj"])
    store = AdapterStore(tmp_path / "adapters")
    lines = import_lora_modules(store, [f"mine={src.path('trained')}"])
    assert store.names() == ["mine"] and "imported mine" in lines[0]
    assert store.content_hash("mine") == src.content_hash("trained")
    # a restart with the same flag keeps the stored copy
    assert "already stored" in import_lora_modules(store, [f"mine={src.path('trained')}"])[0]


def test_lora_modules_never_overwrite_other_content(tmp_path):
    src = AdapterStore(tmp_path / "elsewhere")
    save_random(src, "one", r=2, alpha=4, modules=["q_proj"], seed=1)
    save_random(src, "two", r=2, alpha=4, modules=["q_proj"], seed=2)
    store = AdapterStore(tmp_path / "adapters")
    import_lora_modules(store, [f"mine={src.path('one')}"])
    with pytest.raises(KilnError) as err:
        import_lora_modules(store, [f"mine={src.path('two')}"])
    assert err.value.status == 409


def test_a_folder_that_is_not_an_adapter_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(KilnError, match="adapter_config.json"):
        import_lora_modules(AdapterStore(tmp_path / "adapters"), [f"x={tmp_path / 'empty'}"])


class _Built:
    """What the load hands the engine to: the server's state and `publish`."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(load_error=None, engine=None, require_engine=lambda: self.state.engine)
        self.started: list = []

    def publish(self, engine) -> None:
        self.started.append(engine)
        self.state.engine = engine


class _Engine:
    def __init__(self) -> None:
        self.stopped = threading.Event()

    def join(self) -> None:   # the actor runs until shut down
        self.stopped.wait()

    def shutdown(self) -> None:
        self.stopped.set()


def test_the_model_loads_while_the_server_is_built_and_is_published_once_it_exists():
    built_at = threading.Event()
    engine = _Engine()

    def build(cancel):
        built_at.set()
        return engine

    load = serve._BackgroundLoad(build)
    assert built_at.wait(5)   # the load runs before the server exists
    built, server = _Built(), SimpleNamespace(should_exit=False)
    assert built.started == []
    load.hand_over(built, server)
    deadline = time.monotonic() + 5
    while not built.started and time.monotonic() < deadline:
        time.sleep(0.005)
    assert built.started == [engine] and not server.should_exit and built.state.load_error is None
    load.stop()   # returns at once: the thread parks beside the actor until the engine shuts down
    assert load.thread.is_alive() and not engine.stopped.is_set()
    engine.shutdown()
    load.thread.join(5)
    assert not load.thread.is_alive()


def test_the_collector_off_during_start_up_runs_again_once_the_engine_is_published():
    engine = _Engine()
    gc.disable()   # as `kiln serve` starts
    try:
        load = serve._BackgroundLoad(lambda cancel: engine)
        load.hand_over(_Built(), SimpleNamespace(should_exit=False))
        deadline = time.monotonic() + 5
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
        engine.shutdown()
        load.stop()


def test_a_failed_load_stops_the_server_and_says_why(capsys):
    def build(cancel):
        raise FileNotFoundError("no such model")

    load = serve._BackgroundLoad(build)
    built, server = _Built(), SimpleNamespace(should_exit=False)
    load.hand_over(built, server)
    load.thread.join(5)
    assert server.should_exit and built.started == []
    assert built.state.load_error == "FileNotFoundError: no such model"
    assert "cannot load the model: FileNotFoundError: no such model" in capsys.readouterr().err


def test_stopping_while_the_model_loads_ends_the_load_quietly(capsys):
    from kiln.model.gguf_loader import check_cancel

    tensors_done: list[int] = []

    def build(cancel):
        for i in range(10_000):   # a tensor at a time, as the loaders check
            check_cancel(cancel)
            tensors_done.append(i)
            time.sleep(0.001)
        raise AssertionError("never cancelled")

    load = serve._BackgroundLoad(build)
    while not tensors_done:
        time.sleep(0.001)
    load.stop()   # before any server existed: a configuration error's way out
    assert not load.thread.is_alive() and len(tensors_done) < 10_000
    assert "cannot load" not in capsys.readouterr().err


def test_an_engine_loaded_after_the_server_stopped_is_shut_down_not_published():
    engine = _Engine()
    release = threading.Event()

    def build(cancel):
        release.wait(5)
        return engine

    load = serve._BackgroundLoad(build)
    built, server = _Built(), SimpleNamespace(should_exit=False)
    load.hand_over(built, server)
    stopper = threading.Thread(target=load.stop)
    stopper.start()
    release.set()
    stopper.join(5)
    load.thread.join(5)
    assert built.started == [] and engine.stopped.is_set() and not load.thread.is_alive()
