"""Choosing the kernels' instruction set: the CPU's best by default, a lower one on request
(KILN_CPU_ISA, `engine.cpu_isa`), an error for one the CPU lacks; and what `dtype="auto"` does with it."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model.loader import cpu_auto_dtype, resolve_dtype

AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})


@pytest.fixture(autouse=True)
def _restore_isa():
    with kernels.using_isa("auto"):
        yield


@pytest.fixture
def avx2_only_cpu(monkeypatch: pytest.MonkeyPatch):
    """Flags of an AVX2-only CPU (the Zen 2/3 case) on whatever machine runs the test."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX2_ONLY)


def test_the_supported_isas_run_from_scalar_up_to_the_cpus_best() -> None:
    isas = kernels.cpu_isas()
    assert isas[0] == "scalar"
    assert isas == list(kernels.ISAS[: len(isas)])


def test_auto_picks_the_cpus_best(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    assert kernels.select_isa("auto") == kernels.cpu_isas()[-1]
    assert not kernels.isa_forced()


@pytest.mark.parametrize("isa", kernels.cpu_isas())
def test_the_environment_variable_forces_a_supported_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    monkeypatch.setenv(kernels.ISA_ENV, isa.upper())
    assert kernels.select_isa("auto") == isa
    assert kernels.active_isa() == isa and kernels.isa_forced()


@pytest.mark.parametrize("isa", kernels.cpu_isas())
def test_the_built_library_runs_the_selected_isa(isa: str) -> None:
    module = kernels.load()
    if module is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    with kernels.using_isa(isa):
        assert module.active_isa() == kernels.ISA_LEVELS[isa]
    assert module.active_isa() == kernels.ISA_LEVELS[kernels.active_isa()]


def test_a_setting_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ISA_ENV, kernels.cpu_isas()[-1])
    assert kernels.select_isa("scalar") == "scalar"


def test_an_isa_the_cpu_lacks_is_an_error_naming_what_it_runs(avx2_only_cpu) -> None:
    with pytest.raises(ValueError, match=r"engine.cpu_isa is 'avx512', but this CPU runs only scalar, avx2"):
        kernels.select_isa("avx512")


def test_the_environment_variable_is_named_in_its_error(avx2_only_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=kernels.ISA_ENV):
        kernels.select_isa("auto")


def test_an_unknown_isa_is_an_error_listing_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, scalar, avx2, avx512"):
        kernels.select_isa("sse4")


def test_the_library_refuses_a_level_above_the_cpus() -> None:
    module = kernels.load()
    if module is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    if module.cpu_isa() == kernels.ISA_LEVELS["avx512"]:
        pytest.skip("this CPU runs every level")
    with pytest.raises(ValueError, match="does not support"):
        module.set_isa(kernels.ISA_LEVELS["avx512"])


def test_auto_dtype_is_bfloat16_wherever_the_vector_kernels_run(avx2_only_cpu) -> None:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    with kernels.using_isa("avx2"):
        assert cpu_auto_dtype() == torch.bfloat16
        assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_auto_dtype_without_kernels_is_float32_on_a_cpu_without_native_bf16(avx2_only_cpu, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_disabled", True)
    assert cpu_auto_dtype() == torch.float32


def test_auto_dtype_on_a_cpu_without_avx2_is_float32_unless_scalar_is_asked_for(monkeypatch) -> None:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2"}))
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    with kernels.using_isa("auto"):
        assert cpu_auto_dtype() == torch.float32
    with kernels.using_isa("scalar"):
        assert cpu_auto_dtype() == torch.bfloat16   # the scalar kernels, by name: same bits as AVX2's


def test_the_report_names_the_isa_in_use() -> None:
    with kernels.using_isa("scalar"):
        report = kernels.isa_report()
    assert report["isa"] == "scalar"
    assert report["cpu_isas"] == kernels.cpu_isas()
    assert report["kernels"] in ("ready", "not built", "unavailable")


@pytest.mark.parametrize("isa", kernels.cpu_isas())
def test_prompt_queries_attend_on_the_kernel_as_deep_as_the_isa_says(isa: str) -> None:
    # AVX-512: every prompt position; AVX2: the first AVX2_KERNEL_POSITIONS (torch's SDPA wins deeper);
    # scalar: none (torch's SDPA is the faster there)
    want = {"avx512": 1 << 62, "avx2": kernels.AVX2_KERNEL_POSITIONS, "scalar": 0}[isa]
    with kernels.using_isa(isa):
        assert kernels.chunk_attention_kernel_positions() == want
    assert 0 < kernels.AVX2_KERNEL_POSITIONS < 1 << 62
