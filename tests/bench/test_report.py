from rich.console import Console

from kiln.bench.measurements import decode_spec
from kiln.bench.report import print_report, render_markdown, write_results
from kiln.bench.results import KILN, LLAMACPP, TRANSFORMERS


def table_line(markdown: str, label: str) -> str:
    return next(line for line in markdown.splitlines() if f"| {label} |" in line)


def test_markdown_lists_the_machine_commit_and_date(result):
    md = render_markdown(result)
    assert "| CPU | Example CPU |" in md
    assert "| torch | 2.13.0 |" in md
    assert "`0123abcd`" in md
    assert "2026-01-02 03:04 UTC" in md


def test_markdown_columns_follow_kiln_llamacpp_transformers(result):
    header = next(line for line in render_markdown(result).splitlines() if line.startswith("|  | metric"))
    assert header.index(KILN) < header.index(LLAMACPP) < header.index(TRANSFORMERS)


def test_each_kiln_figure_is_a_ratio_to_llamacpp_when_it_measured_the_row(result):
    line = table_line(render_markdown(result), decode_spec(100).label)
    assert "| 60.0 | 30.0 | 20.0 | 2.00x vs llama.cpp |" in line


def test_ratio_falls_back_to_transformers_without_llamacpp(result_without_llamacpp):
    line = table_line(render_markdown(result_without_llamacpp), decode_spec(100).label)
    assert "3.00x vs transformers" in line


def test_missing_llamacpp_is_said_in_the_table_and_the_notes(result_without_llamacpp):
    md = render_markdown(result_without_llamacpp)
    assert "not installed" in table_line(md, decode_spec(100).label)
    assert "- llama.cpp not measured: llama-cpp-python is not installed" in md


def test_latency_ratios_read_better_than_one_when_kiln_is_faster(result):
    from kiln.bench.measurements import ttft_spec

    result.record(ttft_spec(100), KILN, 50.0)
    result.record(ttft_spec(100), LLAMACPP, 100.0)
    assert "2.00x vs llama.cpp" in table_line(render_markdown(result), ttft_spec(100).label)


def test_targets_section_marks_met_and_missed(result):
    md = render_markdown(result)
    assert "| single-stream decode | >= 1.0x llama.cpp (every prompt length) |" in md
    assert table_line(md, "aggregate throughput, 8 streams").endswith("| MISSED |")


def test_failures_get_their_own_section(result):
    result.failures.append("kiln / itl: BenchError: boom")
    assert "## Failures\n\n- kiln / itl: BenchError: boom" in render_markdown(result)


def test_write_results_creates_the_file(result, tmp_path):
    out = tmp_path / "benchmarks" / "RESULTS.md"
    write_results(result, out)
    assert out.read_text() == render_markdown(result)


def test_terminal_report_shows_every_row(result):
    console = Console(record=True, width=200)
    print_report(result, console)
    text = console.export_text()
    assert decode_spec(500).label in text
    assert "2.00x vs llama.cpp" in text


def test_terminal_report_prints_install_hints_verbatim(result_without_llamacpp):
    result_without_llamacpp.unavailable["llama.cpp"] += "; install with pip install 'kiln[llamacpp]'"
    console = Console(record=True, width=200)
    print_report(result_without_llamacpp, console)
    assert "kiln[llamacpp]" in console.export_text()


def test_a_pipe_in_a_value_does_not_break_the_markdown_table(result):
    result.options["model"] = "a|b"
    assert "| model | a\\|b |" in render_markdown(result)
