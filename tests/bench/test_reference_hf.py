"""The transformers reference on a tiny generated HF model: timing, EOS ignored, sequential "streams"."""

import pytest

from kiln.bench.prompts import BenchPrompt
from kiln.bench.reference_hf import TransformersEngine
from kiln.testing.tiny import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("bench-hf") / "tiny", arch="llama")
    eng = TransformersEngine(str(model), threads=1)
    eng.start()
    yield eng
    eng.close()


def prompt(seed: int, n: int = 12) -> BenchPrompt:
    return BenchPrompt(seed, [], [(seed * 7 + i) % 200 + 10 for i in range(n)])


def test_single_generates_exactly_max_tokens_and_times_them(engine):
    run = engine.single(prompt(1), 9)
    assert run.completion_tokens == 9
    assert run.prompt_tokens == 12
    assert run.ttft_s > 0 and run.decode_tps > 0


def test_concurrent_case_runs_the_requests_one_after_another(engine):
    run = engine.load([prompt(i) for i in range(3)], concurrency=3, max_tokens=4)
    assert run.completion_tokens == 12
    assert run.latencies_s == sorted(run.latencies_s)   # each queued request ends after the previous one
    assert run.latencies_s[-1] <= run.wall_s


def test_transformers_has_no_itl_figure(engine):
    assert engine.itl([prompt(1)], prompt(2, 50), 4, 1) is None
