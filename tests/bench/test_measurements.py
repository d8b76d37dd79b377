from collections.abc import Sequence

import pytest

from kiln.bench.client_load import ItlRun, LoadRun
from kiln.bench.engines import BenchEngine, SingleRun
from kiln.bench.measurements import (
    MEASUREMENTS,
    BenchContext,
    Measurement,
    measure_concurrent,
    measure_itl,
    measure_single,
    select_measurements,
)
from kiln.bench.options import BenchOptions
from kiln.bench.prompts import BenchPrompt
from kiln.bench.results import BenchResult, Comparison
from kiln.bench.runner import run_engine
from kiln.errors import KilnError

from .conftest import machine


class _Prompts:
    def chat(self, n_tokens: int, seed: int) -> BenchPrompt:
        return BenchPrompt(seed, [{"role": "user", "content": str(seed)}], list(range(n_tokens)))


class FakeEngine(BenchEngine):
    """Decode speed rises with each call: 10, 20, 30 ... tok/s, so the median is checkable."""

    def __init__(self, name: str = "kiln") -> None:
        self.name = name
        self.calls: list[tuple[str, object]] = []
        self.started = self.closed = False

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True

    def single(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        self.calls.append(("single", prompt.seed))
        k = sum(1 for c in self.calls if c[0] == "single")
        return SingleRun(prompt.num_tokens, ttft_s=0.1 * k, completion_tokens=max_tokens, decode_tps=10.0 * k)

    def load(self, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int) -> LoadRun:
        self.calls.append(("load", (len(prompts), concurrency)))
        return LoadRun(concurrency, wall_s=2.0, latencies_s=[1.0] * len(prompts),
                       completion_tokens=max_tokens * len(prompts))

    def itl(self, stream_prompts, long_prompt, max_tokens, trigger_tokens) -> ItlRun | None:
        self.calls.append(("itl", (len(stream_prompts), long_prompt.num_tokens)))
        return ItlRun(gaps_s=[0.01] * 98 + [0.05, 0.05], long_prompt_tokens=long_prompt.num_tokens,
                      long_ttft_s=0.5, triggered_after_tokens=trigger_tokens)


def context(**overrides) -> BenchContext:
    options = BenchOptions.preset("model.gguf", **overrides)
    return BenchContext(options=options, result=BenchResult(machine=machine()), prompts=_Prompts(),
                        log=lambda _msg: None)


def test_single_reports_the_median_of_the_repeats():
    ctx = context(single_prompt_tokens=(100,), single_repeats=3)
    measure_single(ctx, FakeEngine())
    assert ctx.result.value("single.decode_tps@100", "kiln") == 20.0
    assert ctx.result.value("single.ttft_ms@100", "kiln") == pytest.approx(200.0)
    assert ctx.result.value("single.prefill_tps@100", "kiln") == pytest.approx(500.0)


def test_every_single_stream_request_gets_its_own_prompt():
    engine = FakeEngine()
    measure_single(context(single_prompt_tokens=(100, 500), single_repeats=2), engine)
    seeds = [seed for kind, seed in engine.calls]
    assert len(set(seeds)) == 4


def test_concurrent_sends_streams_times_requests_per_stream():
    engine = FakeEngine()
    ctx = context(concurrency_levels=(1, 8), requests_per_stream=2, max_tokens=16)
    measure_concurrent(ctx, engine)
    assert engine.calls == [("load", (2, 1)), ("load", (16, 8))]
    assert ctx.result.value("concurrent.agg_tps@8", "kiln") == 16 * 16 / 2.0
    assert ctx.result.value("concurrent.p99_latency_s@8", "kiln") == 1.0


def test_itl_records_percentiles_and_their_spread():
    ctx = context(itl_streams=8, itl_long_prompt_tokens=2000)
    engine = FakeEngine()
    measure_itl(ctx, engine)
    assert engine.calls == [("itl", (8, 2000))]
    assert ctx.result.value("itl.p50_ms", "kiln") == pytest.approx(10.0)
    assert ctx.result.value("itl.p99_ms", "kiln") == pytest.approx(50.0)
    assert ctx.result.value("itl.p99_over_p50", "kiln") == pytest.approx(5.0)


def test_a_serial_servers_itl_is_shown_but_not_compared():
    class Serial(FakeEngine):
        def itl(self, stream_prompts, long_prompt, max_tokens, trigger_tokens):
            run = super().itl(stream_prompts, long_prompt, max_tokens, trigger_tokens)
            run.triggered_after_tokens = 0   # every stream had finished before the long prompt went
            return run

    ctx = context(itl_trigger_tokens=16)
    measure_itl(ctx, FakeEngine("kiln"))
    measure_itl(ctx, Serial("llama-server"))
    row = ctx.result.row("itl.p50_ms")
    assert row.values["llama-server"] == pytest.approx(10.0)
    assert row.ratio(Comparison("kiln", "llama-server", "avx2", "gguf")) is None
    assert any("not compared" in n for n in ctx.result.notes)


def test_an_overlapping_itl_run_is_compared():
    ctx = context(itl_trigger_tokens=16)
    measure_itl(ctx, FakeEngine("kiln"))
    measure_itl(ctx, FakeEngine("llama-server"))
    assert ctx.result.row("itl.p50_ms").ratio(Comparison("kiln", "llama-server", "avx2", "gguf")) == pytest.approx(1.0)


def test_itl_records_the_longest_gap():
    ctx = context()
    measure_itl(ctx, FakeEngine())
    assert ctx.result.value("itl.max_gap_ms", "kiln") == pytest.approx(50.0)


def test_an_engine_without_a_server_measures_single_stream_only():
    class SingleOnly(FakeEngine):
        single_only = True

    ctx = context()
    run_engine(ctx, SingleOnly("transformers"), select_measurements(["single", "concurrent", "itl"]))
    assert ctx.result.value("single.decode_tps@100", "transformers") is not None
    assert ctx.result.row("concurrent.agg_tps@8") is None and ctx.result.failures == []


def test_an_engine_without_itl_records_nothing():
    class NoItl(FakeEngine):
        def itl(self, *args):
            return None

    ctx = context()
    measure_itl(ctx, NoItl("transformers"))
    assert ctx.result.rows == []


def test_only_selects_measurements_in_registry_order():
    assert [m.name for m in select_measurements(("itl", "single"))] == ["single", "itl"]
    assert [m.name for m in select_measurements(())] == [m.name for m in MEASUREMENTS]


def test_unknown_measurement_is_a_400_naming_the_only_option():
    with pytest.raises(KilnError) as e:
        select_measurements(("single", "bogus"))
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_bench_measurement", "only")
    assert "single, concurrent, itl" in e.value.hint


def test_a_measurement_restricted_to_kiln_skips_other_engines():
    ran: list[str] = []
    m = Measurement("adapters", "adapter streams", lambda ctx, eng: ran.append(eng.name), engines=frozenset({"kiln"}))
    ctx = context()
    reference = FakeEngine("transformers")
    run_engine(ctx, reference, [m])
    run_engine(ctx, FakeEngine("kiln"), [m])
    assert ran == ["kiln"]
    assert not reference.started


def test_a_failing_measurement_is_reported_and_the_next_one_still_runs():
    def boom(ctx, engine):
        raise RuntimeError("server went away")

    ctx = context(concurrency_levels=(1,))
    engine = FakeEngine()
    run_engine(ctx, engine, [Measurement("single", "x", boom), Measurement("concurrent", "y", measure_concurrent)])
    assert ctx.result.failures == ["kiln / single: RuntimeError: server went away"]
    assert ctx.result.value("concurrent.agg_tps@1", "kiln") is not None
    assert engine.closed


def test_quick_preset_is_smaller_than_the_full_run():
    full, quick = BenchOptions.preset("m"), BenchOptions.preset("m", quick=True)
    assert quick.max_tokens < full.max_tokens
    assert len(quick.concurrency_levels) < len(full.concurrency_levels)
    assert full.max_tokens == 128 and full.concurrency_levels == (1, 8, 16, 32, 64)
    assert full.itl_long_prompt_tokens == 2000 and full.itl_streams == 8
