import pytest

from kiln.bench.machine import MachineInfo
from kiln.bench.measurements import (
    ITL_MAX,
    ITL_P50,
    ITL_P99,
    ITL_SPREAD,
    aggregate_spec,
    decode_spec,
    prefill_spec,
)
from kiln.bench.results import BenchResult, Comparison


def machine() -> MachineInfo:
    return MachineInfo(cpu_model="Example CPU", logical_cores=2, physical_cores=2, ram_gib=16.0, os="Linux",
                       python="3.11.7", torch="2.13.0", torch_threads=2, transformers="5.0",
                       cpu_isas="scalar, avx2, avx512", kiln="0.1.0", load_average="0.10 / 0.20 / 0.30", date="2026-01-02 03:04", git_commit="0123abcd")


KILN_DEFAULT, KILN_GGUF, REF = "kiln avx512", "kiln gguf avx512", "llama-server avx512"
DEFAULT = Comparison(KILN_DEFAULT, REF, "avx512", "default")
GGUF = Comparison(KILN_GGUF, REF, "avx512", "gguf")


@pytest.fixture
def result() -> BenchResult:
    """Two Kiln engines against llama-server on AVX-512: the GGUF Kiln decodes 2x, prefills 4x and
    serves 8 streams 3x llama-server; the default-weights Kiln decodes 0.8x."""
    r = BenchResult(machine=machine(), options={"mode": "full"}, engine_order=[KILN_DEFAULT, KILN_GGUF, REF],
                    comparisons=[DEFAULT, GGUF])
    for n, (d, k, ll) in {100: (24.0, 60.0, 30.0), 500: (20.0, 50.0, 25.0)}.items():
        r.record(decode_spec(n), KILN_DEFAULT, d)
        r.record(decode_spec(n), KILN_GGUF, k)
        r.record(decode_spec(n), REF, ll)
    r.record(prefill_spec(500), KILN_GGUF, 4000.0)
    r.record(prefill_spec(500), REF, 1000.0)
    r.record(aggregate_spec(8), KILN_GGUF, 300.0)
    r.record(aggregate_spec(8), REF, 100.0)
    r.record(ITL_P50, KILN_GGUF, 20.0)
    r.record(ITL_P99, KILN_GGUF, 50.0)
    r.record(ITL_SPREAD, KILN_GGUF, 2.5)
    r.record(ITL_MAX, KILN_GGUF, 120.0)
    return r


@pytest.fixture
def result_without_reference() -> BenchResult:
    r = BenchResult(machine=machine(), engine_order=[KILN_GGUF, REF], comparisons=[GGUF])
    r.record(decode_spec(100), KILN_GGUF, 60.0)
    r.unavailable[REF] = "no llama-server (native) found: pass --llama-server PATH"
    return r
