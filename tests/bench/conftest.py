import pytest

from kiln.bench.machine import MachineInfo
from kiln.bench.measurements import ITL_P50, ITL_P99, ITL_SPREAD, aggregate_spec, decode_spec, prefill_spec
from kiln.bench.results import KILN, LLAMACPP, TRANSFORMERS, BenchResult


def machine() -> MachineInfo:
    return MachineInfo(cpu_model="Example CPU", logical_cores=2, physical_cores=2, ram_gib=16.0, os="Linux",
                       python="3.11.7", torch="2.13.0", torch_threads=2, transformers="5.0",
                       llama_cpp_python="0.3.0", kiln="0.1.0", load_average="0.10 / 0.20 / 0.30", date="2026-01-02 03:04", git_commit="0123abcd")


@pytest.fixture
def result() -> BenchResult:
    """Kiln, llama.cpp and transformers figures: decode 2x, prefill 4x, 8-stream aggregate 3x llama.cpp."""
    r = BenchResult(machine=machine(), options={"mode": "full"})
    for n, (k, ll, hf) in {100: (60.0, 30.0, 20.0), 500: (50.0, 25.0, 15.0)}.items():
        r.record(decode_spec(n), KILN, k)
        r.record(decode_spec(n), LLAMACPP, ll)
        r.record(decode_spec(n), TRANSFORMERS, hf)
    r.record(prefill_spec(500), KILN, 4000.0)
    r.record(prefill_spec(500), LLAMACPP, 1000.0)
    r.record(aggregate_spec(8), KILN, 300.0)
    r.record(aggregate_spec(8), LLAMACPP, 100.0)
    r.record(ITL_P50, KILN, 20.0)
    r.record(ITL_P99, KILN, 50.0)
    r.record(ITL_SPREAD, KILN, 2.5)
    return r


@pytest.fixture
def result_without_llamacpp() -> BenchResult:
    r = BenchResult(machine=machine())
    r.record(decode_spec(100), KILN, 60.0)
    r.record(decode_spec(100), TRANSFORMERS, 20.0)
    r.unavailable[LLAMACPP] = "llama-cpp-python is not installed (llama_cpp)"
    return r
