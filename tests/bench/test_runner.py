import sys

import pytest

from kiln.bench.engines import KilnServerEngine, Unsupported
from kiln.bench.measurements import Measurement
from kiln.bench.options import BenchOptions
from kiln.bench.reference_hf import TransformersEngine
from kiln.bench.reference_llamacpp import llamacpp_status
from kiln.bench.results import LLAMACPP, BenchResult
from kiln.bench.runner import build_engines, check_model_path, run_engine
from kiln.errors import KilnError

from .conftest import machine
from .test_measurements import FakeEngine, context


@pytest.fixture
def no_llamacpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # any import of it now raises ImportError


def test_llamacpp_status_says_why_it_cannot_be_used(no_llamacpp):
    ok, why = llamacpp_status()
    assert not ok
    assert "not installed" in why


def test_without_llamacpp_the_run_notes_it_and_still_measures_transformers(no_llamacpp):
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf"), result, [2])
    assert [type(e) for e in engines] == [KilnServerEngine, TransformersEngine]
    assert "not installed" in result.unavailable[LLAMACPP]
    assert "kiln[llamacpp]" in result.unavailable[LLAMACPP]


def test_skip_reference_measures_kiln_alone():
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf", skip_reference=True), result, [2])
    assert [type(e) for e in engines] == [KilnServerEngine]
    assert result.notes == ["reference engines skipped (--skip-reference): no ratios"]


def test_an_unsupported_measurement_is_a_note_not_a_failure():
    def needs_server(ctx, engine):
        raise Unsupported("its server needs starlette_context")

    ctx = context()
    run_engine(ctx, FakeEngine(LLAMACPP), [Measurement("concurrent", "x", needs_server)])
    assert ctx.result.failures == []
    assert ctx.result.notes == ["llama.cpp skipped concurrent: its server needs starlette_context"]


def test_an_engine_that_does_not_start_is_a_failure_and_is_closed():
    class Broken(FakeEngine):
        def start(self):
            raise RuntimeError("port in use")

    ctx = context()
    engine = Broken()
    run_engine(ctx, engine, [Measurement("single", "x", lambda c, e: None)])
    assert ctx.result.failures == ["kiln: could not start: RuntimeError: port in use"]
    assert engine.closed


def test_a_missing_model_is_a_400_naming_the_model_option(tmp_path):
    with pytest.raises(KilnError) as e:
        check_model_path(str(tmp_path / "nope.gguf"))
    assert (e.value.status, e.value.code, e.value.param) == (400, "model_not_found", "model")


def test_cli_rejects_an_unknown_measurement_with_a_hint(tmp_path, capsys):
    from kiln.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert main(["bench", "--model", str(model), "--only", "single,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown measurement(s): nope" in err
    assert "hint: Choose from: single, concurrent, itl" in err


def test_a_checkpoint_follows_each_engine_and_only_the_last_is_complete(tmp_path):
    from kiln.bench.runner import run_bench
    from kiln.testing.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", arch="llama")
    options = BenchOptions.preset(str(model), only=("concurrent",), concurrency_levels=(2,))
    seen: list[tuple[bool, list[str]]] = []
    result = run_bench(options, log=lambda _m: None, engines=[FakeEngine("kiln"), FakeEngine("transformers")],
                       checkpoint=lambda r: seen.append((r.complete, r.engines())))
    assert seen == [(False, ["kiln"]), (True, ["kiln", "transformers"])]
    assert result.complete


def test_a_partial_result_says_so_in_the_markdown(result):
    from kiln.bench.report import render_markdown

    assert "Partial run" not in render_markdown(result)
    result.complete = False
    assert "**Partial run**" in render_markdown(result)


def test_a_gguf_is_benchmarked_with_its_own_quantized_blocks_by_default():
    assert BenchOptions.preset("model.Q4_1.gguf").kiln_quantization == "gguf"
    assert BenchOptions.preset("/models/hf-dir").kiln_quantization == "none"
    assert BenchOptions.preset("model.gguf", quantization="none").kiln_quantization == "none"
    assert "gguf" in BenchOptions.preset("model.gguf").describe()["Kiln weights"]


def test_the_kiln_server_is_started_with_the_chosen_quantization():
    engines = build_engines(BenchOptions.preset("m.gguf", skip_reference=True, quantization="q8_0"),
                            BenchResult(machine=machine()), [2])
    assert engines[0].quantization == "q8_0"
