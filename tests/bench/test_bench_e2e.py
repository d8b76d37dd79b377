"""The harness end to end against a real `kiln serve` on a tiny generated model (small sizes)."""

from pathlib import Path

import httpx
import pytest

from kiln.bench.options import BenchOptions
from kiln.bench.report import render_markdown
from kiln.bench.runner import run_bench
from kiln.model import kernels
from kiln.testing.tiny import make_tiny_model

pytestmark = pytest.mark.e2e
# an HF directory: the default weights only, on the CPU's own ISA
KILN_NATIVE = f"kiln {kernels.cpu_isas()[-1]}"


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("bench-e2e") / "tiny", arch="llama")
    options = BenchOptions.preset(
        str(model), skip_reference=True, out=Path("unused.md"), threads=1, max_tokens=6,
        single_prompt_tokens=(40,), single_repeats=1, concurrency_levels=(2,), requests_per_stream=1,
        concurrent_prompt_tokens=30, itl_streams=2, itl_max_tokens=12, itl_long_prompt_tokens=200,
        itl_trigger_tokens=3, warmup_prompt_tokens=20, adapter_streams=2, adapter_count=2, adapter_rank=4,
        adapter_repeats=1, training_streams=2, isas=("native",))
    return run_bench(options, log=lambda _msg: None)


def test_every_measurement_produces_kiln_figures_through_the_server(tiny_result):
    assert tiny_result.failures == []
    for key in ("single.decode_tps@40", "single.prefill_tps@40", "single.ttft_ms@40", "concurrent.agg_tps@2",
                "concurrent.p99_latency_s@2", "itl.p50_ms", "itl.p99_ms", "itl.long_ttft_ms",
                "adapters.base_agg_tps", "adapters.mixed_agg_tps", "adapters.mixed_over_base",
                "training.tokens_per_sec", "training.itl_p99_idle_ms", "training.itl_p99_busy_ms",
                "training.itl_p99_ratio"):
        assert tiny_result.value(key, KILN_NATIVE) > 0, key


def test_the_kiln_server_is_named_after_the_isa_its_health_reports(tiny_result):
    assert tiny_result.engine_order == [KILN_NATIVE]
    # "native" is the CPU's best unless KILN_CPU_ISA forces another (the whole suite run on AVX2).
    requested = kernels.requested_isa()
    expected = kernels.cpu_isas()[-1] if requested == "auto" else requested
    assert tiny_result.options[f"{KILN_NATIVE}: kernels' ISA (its /health)"] == expected


def actual_tokens(result, key: str) -> int:
    return int(result.options[key].split()[0])


def test_prompt_lengths_are_the_servers_own_counts_near_the_target(tiny_result):
    # The server may add a few template tokens the harness does not render (e.g. an empty think block).
    assert 40 <= actual_tokens(tiny_result, "~40-token prompt (actual)") <= 48
    assert 200 <= actual_tokens(tiny_result, "long prompt (actual)") <= 208


def test_the_report_renders_from_a_real_run(tiny_result):
    md = render_markdown(tiny_result)
    assert "| **single stream** | decode tok/s after ~40-token prompt | tok/s |" in md


def test_a_running_server_keeps_its_own_adapters_and_loses_the_ones_the_bench_uploaded(tmp_path):
    from kiln.bench import adapter_load
    from kiln.bench.engines import KilnServerEngine

    model = make_tiny_model(tmp_path / "tiny", arch="llama")
    server = KilnServerEngine(str(model), threads=1)
    server.start()
    try:
        url = server.endpoint.base_url
        # one of the bench's names is on the server already, as if the user had kept it
        adapter_load.upload_adapters(server.endpoint, str(model), count=1, rank=4)
        options = BenchOptions.preset(
            str(model), skip_reference=True, out=Path("unused.md"), threads=1, max_tokens=4, kiln_url=url,
            only=("adapters",), adapter_streams=2, adapter_count=2, adapter_rank=4, adapter_repeats=1)
        result = run_bench(options, log=lambda _msg: None)
        assert result.failures == []
        assert result.value("adapters.mixed_over_base", result.engine_order[0]) > 0
        available = httpx.get(url + "/v1/adapters").json()["available"]
        assert sorted(a["name"] for a in available) == [f"{adapter_load.ADAPTER_PREFIX}-r4-0"]
    finally:
        server.close()
