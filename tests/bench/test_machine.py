from kiln.bench.machine import MachineInfo, cpu_model, physical_cores

CPUINFO = """processor\t: 0
model name\t: Example CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 0

processor\t: 1
model name\t: Example CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 0

processor\t: 2
model name\t: Example CPU @ 3.00GHz
physical id\t: 0
core id\t\t: 1
"""


def test_cpu_model_comes_from_the_model_name_line():
    assert cpu_model(CPUINFO) == "Example CPU @ 3.00GHz"


def test_physical_cores_count_distinct_cores_not_hyperthreads():
    assert physical_cores(CPUINFO) == 2


def test_physical_cores_unknown_without_core_ids():
    assert physical_cores("processor\t: 0\n") is None


def test_machine_rows_label_every_field_and_show_missing_as_a_dash():
    info = MachineInfo("cpu", 4, None, 8.0, "Linux", "3.11", "2.13", 4, "5.0", "scalar, avx2", "0.1.0",
                       "0.5 / 0.5 / 0.5", "2026-01-01 00:00", "abc123")
    rows = dict(info.as_rows())
    assert rows["CPU"] == "cpu"
    assert rows["physical cores"] == "—"
    assert rows["git commit"] == "abc123"
    assert rows["ISAs this CPU runs (Kiln's kernels)"] == "scalar, avx2"
