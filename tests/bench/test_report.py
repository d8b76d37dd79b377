from rich.console import Console

from kiln.bench.measurements import decode_spec
from kiln.bench.report import print_report, render_markdown, write_results

from .conftest import KILN_DEFAULT, KILN_GGUF, REF


def table_line(markdown: str, label: str) -> str:
    return next(line for line in markdown.splitlines() if f"| {label} |" in line)


def test_markdown_lists_the_machine_commit_and_date(result):
    md = render_markdown(result)
    assert "| CPU | Example CPU |" in md
    assert "| torch | 2.13.0 |" in md
    assert "| ISAs this CPU runs (Kiln's kernels) | scalar, avx2, avx512 |" in md
    assert "`0123abcd`" in md
    assert "2026-01-02 03:04 UTC" in md


def test_columns_follow_the_engines_then_one_ratio_per_comparison(result):
    header = next(line for line in render_markdown(result).splitlines() if line.startswith("|  | metric"))
    assert header.index(KILN_DEFAULT) < header.index(KILN_GGUF) < header.index(f"| {REF} |")
    assert header.index(f"{KILN_DEFAULT} / {REF}") < header.index(f"{KILN_GGUF} / {REF}")


def test_each_kiln_engine_gets_its_ratio_to_llama_server_on_the_same_isa(result):
    line = table_line(render_markdown(result), decode_spec(100).label)
    assert "| 24.0 | 60.0 | 30.0 | 0.80x | 2.00x |" in line


def test_missing_llama_server_is_said_in_the_table_and_the_notes(result_without_reference):
    md = render_markdown(result_without_reference)
    assert "| 60.0 | unavailable | — |" in table_line(md, decode_spec(100).label)
    assert f"- {REF} not measured: no llama-server (native) found" in md


def test_latency_ratios_read_better_than_one_when_kiln_is_faster(result):
    from kiln.bench.measurements import ttft_spec

    result.record(ttft_spec(100), KILN_GGUF, 50.0)
    result.record(ttft_spec(100), REF, 100.0)
    assert table_line(render_markdown(result), ttft_spec(100).label).endswith("| — | 2.00x |")


def test_targets_section_marks_met_and_missed(result):
    md = render_markdown(result)
    assert table_line(md, "single-stream decode, gguf (avx512)").endswith("| met |")
    assert table_line(md, "single-stream decode, default weights (avx512)").endswith("| MISSED |")


def test_failures_get_their_own_section(result):
    result.failures.append("kiln / itl: BenchError: boom")
    assert "## Failures\n\n- kiln / itl: BenchError: boom" in render_markdown(result)


def test_write_results_creates_the_file(result, tmp_path):
    out = tmp_path / "benchmarks" / "RESULTS.md"
    write_results(result, out)
    assert out.read_text() == render_markdown(result)


def test_terminal_report_shows_every_row_and_ratio(result):
    console = Console(record=True, width=240)
    print_report(result, console)
    text = console.export_text()
    assert decode_spec(500).label in text
    assert "2.00x" in text and "0.80x" in text


def test_terminal_report_prints_hints_verbatim(result_without_reference):
    result_without_reference.unavailable[REF] += "; e.g. [llamacpp] --build-llama-server"
    console = Console(record=True, width=240)
    print_report(result_without_reference, console)
    assert "[llamacpp] --build-llama-server" in console.export_text()


def test_a_pipe_in_a_value_does_not_break_the_markdown_table(result):
    result.options["model"] = "a|b"
    assert "| model | a\\|b |" in render_markdown(result)
