"""The llama.cpp reference against the real `llama_cpp` on the embedded GGUF, where the optional
`llamacpp` extra is installed (it is built from source, so CI does not have it)."""

import pytest

from kiln.bench.engines import Unsupported
from kiln.bench.prompts import BenchPrompt
from kiln.bench.reference_llamacpp import LlamaCppEngine, llamacpp_server_missing
from kiln.model.loader import default_model_path

pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra: pip install 'kiln[llamacpp]'")
pytestmark = pytest.mark.slow


def prompt(seed: int) -> BenchPrompt:
    return BenchPrompt(seed, [{"role": "user", "content": f"Count from {seed} upwards."}], list(range(1000 + seed, 1040 + seed)))


@pytest.fixture
def engine():
    e = LlamaCppEngine(str(default_model_path()), threads=2, eos_token_ids=[0, 1, 2])
    yield e
    e.close()


def test_single_stream_generates_exactly_max_tokens_from_a_full_prefill(engine):
    run = engine.single(prompt(1), 6)
    assert (run.prompt_tokens, run.completion_tokens) == (40, 6)
    assert run.ttft_s > 0 and run.decode_tps and run.decode_tps > 0


def test_its_server_serves_concurrent_streams_of_max_tokens_each(engine):
    if llamacpp_server_missing():
        with pytest.raises(Unsupported):
            engine.load([prompt(2), prompt(3)], 2, 5)
        return
    run = engine.load([prompt(2), prompt(3)], 2, 5)
    assert run.completion_tokens == 10 and len(run.latencies_s) == 2 and run.aggregate_tps > 0
