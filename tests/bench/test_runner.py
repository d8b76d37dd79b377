import os

import pytest

from kiln.bench import llama_server
from kiln.bench.engines import AVX2_ENV, KilnServerEngine, Unsupported
from kiln.bench.llama_server import LlamaServerEngine
from kiln.bench.measurements import Measurement
from kiln.bench.options import BenchOptions
from kiln.bench.results import BenchResult, Comparison
from kiln.bench.runner import build_engines, check_model_path, run_engine
from kiln.errors import KilnError

from .conftest import machine
from .test_measurements import FakeEngine, context

AVX512_CPU = ["scalar", "avx2", "avx512"]


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    """An executable named llama-server on PATH (never started here) and no build-script cache."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\necho 'version: 1 (test)'\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LLAMA_SERVER_CACHE", str(tmp_path / "empty-cache"))
    for var in (*llama_server.ENV.values(), llama_server.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)
    return binary


@pytest.fixture
def no_llama_server(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("LLAMA_SERVER_CACHE", str(tmp_path / "empty-cache"))
    for var in (*llama_server.ENV.values(), llama_server.BUILD_ENV):
        monkeypatch.delenv(var, raising=False)


def names(engines):
    return [e.name for e in engines]


def test_a_gguf_runs_both_kiln_weights_against_llama_server_and_the_avx2_pair_on_avx512(fake_llama_server):
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf"), result, cpu_isas=AVX512_CPU)
    assert names(engines) == ["kiln avx512", "kiln gguf avx512", "llama-server avx512", "kiln avx2", "kiln gguf avx2"]
    assert "no llama-server (avx2) found" in result.unavailable["llama-server avx2"]
    assert result.comparisons == [Comparison("kiln avx512", "llama-server avx512", "avx512", "default"),
                                  Comparison("kiln gguf avx512", "llama-server avx512", "avx512", "gguf"),
                                  Comparison("kiln avx2", "llama-server avx2", "avx2", "default"),
                                  Comparison("kiln gguf avx2", "llama-server avx2", "avx2", "gguf")]
    assert isinstance(engines[2], LlamaServerEngine) and engines[2].binary == str(fake_llama_server)


def test_the_avx2_pair_forces_kiln_and_uses_the_avx2_build(fake_llama_server, tmp_path):
    avx2 = tmp_path / "cache" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build-avx2" / "bin"
    avx2.mkdir(parents=True)
    (avx2 / "llama-server").write_bytes(fake_llama_server.read_bytes())
    (avx2 / "llama-server").chmod(0o755)
    os.environ["LLAMA_SERVER_CACHE"] = str(tmp_path / "cache")
    engines = build_engines(BenchOptions.preset("m.gguf"), BenchResult(machine=machine()), cpu_isas=AVX512_CPU)
    assert names(engines)[3:] == ["kiln avx2", "kiln gguf avx2", "llama-server avx2"]
    assert engines[3].isa == "avx2" and engines[3].primary and not engines[4].primary
    assert engines[5].binary == str(avx2 / "llama-server")


def test_an_avx2_cpu_measures_one_isa():
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf", skip_reference=True), result, cpu_isas=["scalar", "avx2"])
    assert names(engines) == ["kiln avx2", "kiln gguf avx2"]
    assert engines[0].isa is None   # the CPU's own best: nothing forced


def test_without_llama_server_the_run_says_how_to_get_one(no_llama_server):
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf", isas=("native",)), result, cpu_isas=AVX512_CPU)
    assert names(engines) == ["kiln avx512", "kiln gguf avx512"]
    why = result.unavailable["llama-server avx512"]
    assert "--llama-server PATH" in why and "--build-llama-server" in why


def test_an_explicit_binary_that_is_not_there_is_reported(no_llama_server, tmp_path):
    result = BenchResult(machine=machine())
    build_engines(BenchOptions.preset("m.gguf", isas=("native",), llama_server=str(tmp_path / "nope")), result,
                  cpu_isas=AVX512_CPU)
    assert "is not an executable file" in result.unavailable["llama-server avx512"]


def test_the_build_script_builds_a_missing_server_for_the_asked_isa(no_llama_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")   # the script's own tools; no llama-server there
    script = tmp_path / "build"
    out = tmp_path / "built-llama-server"
    script.write_text(f"#!/bin/sh\necho building $ISA >&2\ntouch {out}-$ISA; chmod +x {out}-$ISA\n"
                      f"echo {out}-$ISA\n")
    script.chmod(0o755)
    found = llama_server.locate("avx2", build_script=str(script))
    assert found.path == f"{out}-avx2" and "built by" in found.how


def test_llama_server_is_started_with_continuous_batching_slots_on_loopback():
    engine = LlamaServerEngine("llama-server avx512", "/bin/llama-server", "m.gguf", 2, "avx512")
    args = engine.args(8090)
    assert args[:3] == ["/bin/llama-server", "-m", "m.gguf"]
    for flag, value in (("-t", "2"), ("-np", "64"), ("-c", "131072"), ("--host", "127.0.0.1"), ("--port", "8090")):
        assert args[args.index(flag) + 1] == value
    assert engine.endpoint.extra_body == {"ignore_eos": True}


def test_the_avx2_kiln_server_forces_torch_and_the_kernels_to_avx2():
    assert AVX2_ENV["KILN_CPU_ISA"] == "avx2" and AVX2_ENV["ATEN_CPU_CAPABILITY"] == "avx2"


def test_skip_reference_measures_kiln_alone():
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("m.gguf", skip_reference=True, isas=("native",)), result,
                            cpu_isas=AVX512_CPU)
    assert all(isinstance(e, KilnServerEngine) for e in engines)
    assert result.notes == ["reference engines skipped (--skip-reference): no ratios"]


def test_an_hf_directory_has_no_llama_server_reference(fake_llama_server):
    result = BenchResult(machine=machine())
    engines = build_engines(BenchOptions.preset("/models/hf", isas=("native",)), result, cpu_isas=AVX512_CPU)
    assert names(engines) == ["kiln avx512"]
    assert result.unavailable["llama-server avx512"] == "the model is not a .gguf file"


def test_an_unsupported_measurement_is_a_note_not_a_failure():
    def needs_server(ctx, engine):
        raise Unsupported("its server needs starlette_context")

    ctx = context()
    run_engine(ctx, FakeEngine("llama-server avx512"), [Measurement("concurrent", "x", needs_server)])
    assert ctx.result.failures == []
    assert ctx.result.notes == ["llama-server avx512 skipped concurrent: its server needs starlette_context"]


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


def test_a_gguf_is_benchmarked_with_the_default_weights_and_its_own_blocks():
    assert BenchOptions.preset("model.Q4_1.gguf").kiln_quantizations == ("auto", "gguf")
    assert BenchOptions.preset("/models/hf-dir").kiln_quantizations == ("auto",)
    assert BenchOptions.preset("model.gguf", quantization="q8_0").kiln_quantizations == ("q8_0",)
    assert "gguf (kiln serve --quantization gguf)" in BenchOptions.preset("model.gguf").describe()["Kiln weights"]


def test_a_running_server_is_measured_once_not_again_from_its_prefix_cache():
    options = BenchOptions.preset("model.gguf", kiln_url="http://127.0.0.1:8000")
    assert options.kiln_quantizations == ("auto",)
    engines = build_engines(options, BenchResult(machine=machine()), cpu_isas=AVX512_CPU)
    assert [e.name for e in engines if e.name.startswith("kiln")] == ["kiln avx512"]


def test_the_kiln_server_is_started_with_the_chosen_quantization():
    engines = build_engines(BenchOptions.preset("m.gguf", skip_reference=True, quantization="q8_0", isas=("native",)),
                            BenchResult(machine=machine()), cpu_isas=AVX512_CPU)
    assert [(e.name, e.quantization) for e in engines] == [("kiln q8_0 avx512", "q8_0")]


def test_cli_rejects_an_unknown_isa(tmp_path, capsys):
    from kiln.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    assert main(["bench", "--model", str(model), "--isa", "sse"]) == 2
    assert "--isa takes native, avx2 or both" in capsys.readouterr().err
