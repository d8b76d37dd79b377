import asyncio

import pytest

from kiln.bench.client_load import (
    BenchError,
    Endpoint,
    StreamRecord,
    concurrent_streams,
    discover_model,
    single_stream,
    streams_with_long_arrival,
)
from kiln.bench.engines import HttpEngine
from kiln.bench.prompts import BenchPrompt

from .fake_server import make_app, serve


def prompt(seed: int, words: int = 10, text: str = "w") -> BenchPrompt:
    return BenchPrompt(seed, [{"role": "user", "content": " ".join([text] * words)}], list(range(words)))


@pytest.fixture(scope="module")
def fake():
    app = make_app()
    with serve(app) as url:
        yield app, Endpoint("fake", url, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def serial_fake():
    with serve(make_app(serial=True)) as url:
        yield Endpoint("serial", url)


def test_decode_rate_excludes_the_first_token():
    rec = StreamRecord(start=0.0, token_times=[1.0, 1.5, 2.0, 3.0], completion_tokens=4)
    assert rec.ttft == 1.0
    assert rec.decode_tps == 3 / 2.0
    assert rec.gaps() == [0.5, 0.5, 1.0]


def test_usage_token_count_wins_over_chunk_count():
    rec = StreamRecord(start=0.0, token_times=[1.0, 2.0], completion_tokens=5)
    assert rec.num_tokens == 5
    assert rec.decode_tps == 4.0


def test_one_stream_times_every_output_chunk_and_reads_usage(fake):
    _, endpoint = fake
    rec = asyncio.run(single_stream(endpoint, prompt(1, words=12), 6))
    assert len(rec.token_times) == 6
    assert (rec.prompt_tokens, rec.completion_tokens) == (12, 6)
    assert 0 < rec.ttft <= rec.latency
    assert rec.decode_tps > 0


def test_requests_are_greedy_streaming_with_usage_and_the_engines_extra_fields(fake):
    app, endpoint = fake
    asyncio.run(single_stream(endpoint, prompt(2), 3))
    body = app.state.bodies[-1]
    assert body["temperature"] == 0.0 and body["stream"] is True and body["max_tokens"] == 3
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True


def test_an_http_error_is_a_bench_error_with_the_server_message(fake):
    _, endpoint = fake
    with pytest.raises(BenchError, match="HTTP 400.*bad prompt"):
        asyncio.run(single_stream(endpoint, prompt(3, text="FAIL"), 3))


def test_concurrent_streams_count_every_generated_token(fake):
    _, endpoint = fake
    run = asyncio.run(concurrent_streams(endpoint, [prompt(i) for i in range(6)], 3, 5))
    assert run.completion_tokens == 30
    assert len(run.latencies_s) == 6
    assert run.aggregate_tps == pytest.approx(30 / run.wall_s)


def test_the_long_prompt_waits_until_every_stream_has_produced_the_trigger_count(fake):
    app, endpoint = fake
    run = asyncio.run(streams_with_long_arrival(endpoint, [prompt(i) for i in range(4)],
                                                prompt(99, words=200), max_tokens=20, trigger_tokens=5))
    assert run.triggered_after_tokens >= 5
    assert run.long_prompt_tokens == 200
    assert len(run.gaps_s) == 4 * 19
    assert app.state.bodies[-1]["max_tokens"] == 8   # the long request: a prefill, then a few tokens


def test_a_server_running_one_request_at_a_time_still_gets_the_long_prompt(serial_fake):
    run = asyncio.run(streams_with_long_arrival(serial_fake, [prompt(i) for i in range(3)], prompt(99),
                                                max_tokens=4, trigger_tokens=2))
    assert run.triggered_after_tokens < 2
    assert run.long_ttft_s is not None


def test_the_served_model_id_is_discovered(fake):
    _, endpoint = fake
    assert asyncio.run(discover_model(endpoint)) == "fake-model"


def test_http_engine_wraps_a_stream_into_a_single_run(fake):
    _, endpoint = fake
    run = HttpEngine(endpoint).single(prompt(5, words=30), 4)
    assert (run.prompt_tokens, run.completion_tokens) == (30, 4)
    assert run.prefill_tps == pytest.approx(30 / run.ttft_s)


def test_kiln_engine_pointed_at_a_running_server_starts_nothing_and_finds_its_model(fake):
    from kiln.bench.engines import KilnServerEngine

    _, endpoint = fake
    engine = KilnServerEngine("unused.gguf", threads=1, url=endpoint.base_url)
    engine.start()
    try:
        assert engine.server is None
        assert engine.endpoint.model == "fake-model"
        assert engine.single(prompt(6), 3).completion_tokens == 3
    finally:
        engine.close()
