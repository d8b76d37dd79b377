"""The llama.cpp reference against a stand-in `llama_cpp` module (the real one is an optional extra)."""

import sys
import types

import pytest

from kiln.bench import reference_llamacpp
from kiln.bench.engines import Unsupported
from kiln.bench.prompts import BenchPrompt
from kiln.bench.reference_llamacpp import LlamaCppEngine, llamacpp_status


class FakeLlama:
    instances: list["FakeLlama"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.resets = 0
        self.prompts: list[list[int]] = []
        FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **sampling):
        self.prompts.append(list(tokens))
        self.sampling = sampling
        while True:          # like llama.cpp: never stops on its own, EOS included
            yield 2


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.instances = []
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama, __version__="9.9.9"))


def prompt(n: int = 20) -> BenchPrompt:
    return BenchPrompt(1, [], list(range(n)))


def test_status_reports_the_installed_version(fake_llama_cpp):
    assert llamacpp_status() == (True, "9.9.9")


def test_single_stream_stops_at_max_tokens_even_through_eos(fake_llama_cpp):
    engine = LlamaCppEngine("m.gguf", threads=3, eos_token_ids=[2])
    run = engine.single(prompt(), 7)
    assert (run.prompt_tokens, run.completion_tokens) == (20, 7)
    llm = FakeLlama.instances[0]
    assert llm.kwargs["n_threads"] == 3 and llm.kwargs["model_path"] == "m.gguf"
    assert llm.sampling["temp"] == 0.0 and llm.sampling["top_k"] == 1


def test_every_single_stream_run_starts_from_an_empty_cache(fake_llama_cpp):
    engine = LlamaCppEngine("m.gguf", threads=1, eos_token_ids=[2])
    engine.warmup(prompt(5))
    engine.single(prompt(), 3)
    engine.single(prompt(), 3)
    llm = FakeLlama.instances[0]
    assert llm.resets == 3                      # warm-up included
    assert [len(p) for p in llm.prompts] == [5, 20, 20]


def test_its_server_requests_suppress_eos_with_a_logit_bias(fake_llama_cpp):
    engine = LlamaCppEngine("m.gguf", threads=1, eos_token_ids=[2, 0])
    assert engine.endpoint.extra_body == {"logit_bias": {"2": -100.0, "0": -100.0}}


def test_without_its_server_extra_the_concurrent_case_is_unsupported(fake_llama_cpp, monkeypatch):
    monkeypatch.setattr(reference_llamacpp, "llamacpp_server_missing", lambda: ["starlette_context"])
    engine = LlamaCppEngine("m.gguf", threads=1, eos_token_ids=[2])
    with pytest.raises(Unsupported, match="llama-cpp-python\\[server\\]"):
        engine.load([prompt()], 1, 4)


def test_llamacpp_needs_a_gguf_file():
    with pytest.raises(ValueError):
        LlamaCppEngine("model-dir", threads=1, eos_token_ids=[2])
