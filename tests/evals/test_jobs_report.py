"""Paired comparison statistics, the HTML report and the CLI that writes it, over finished fake jobs."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kiln.cli import main as cli_main
from kiln.evals.compare import compare_pair, compare_runs, flip_class
from kiln.evals.intake import job_for_compare
from kiln.evals.report import render_report
from kiln.evals.requests import parse_compare_spec
from tests.evals.test_jobs_fixtures import FakeGenerator, arithmetic, make_manager


def run_of(kinds: dict[str, str], adapter=None) -> dict:
    return {"adapter": adapter, "aggregated_outcomes": [{"example_id": k, "kind": v} for k, v in kinds.items()]}


@pytest.fixture
def compare_result(tmp_path):
    """A compare job: base gets 3+3 wrong, the second run ("tuned") fixes it and breaks 5+5."""
    def answer(req):
        if req.adapter == "tuned":
            return {"3 + 3?": "6", "5 + 5?": "<b>eleven</b>"}.get(str(req.messages[-1]["content"]), arithmetic(req))
        return arithmetic(req)

    manager, _ = make_manager(tmp_path, FakeGenerator(answer), adapters={"tuned": "sha256:" + "e" * 64})
    job = manager.submit(job_for_compare(manager.ctx, parse_compare_spec({"suite": "math", "adapters": ["", "tuned"]})))
    asyncio.run(manager.run_job(job))
    return job.result()


def test_flip_classes_follow_pass_versus_not_pass():
    assert [flip_class("pass", "pass"), flip_class("pass", "invalid"), flip_class("error", "pass"),
            flip_class("fail", "invalid")] == ["both_pass", "regressed", "improved", "both_fail"]


def test_pairs_are_matched_by_example_id_and_tested_with_the_sign_test():
    before = {f"e{i}": "fail" for i in range(9)} | {"r1": "pass", "r2": "pass", "x": "pass"}
    after = {f"e{i}": "pass" for i in range(9)} | {"r1": "fail", "r2": "error", "y": "pass"}
    c = compare_pair([run_of(before), run_of(after, "tuned")], 0, 1)
    assert (c.improved, c.regressed, c.both_pass, c.both_fail, c.num_paired) == (9, 2, 0, 0, 11)
    assert c.p_value == pytest.approx(134 / 2048)
    assert not c.significant
    assert (c.baseline, c.candidate) == ("<base>", "tuned")
    assert ("r2", "regressed") in c.flips


def test_compare_runs_compares_every_run_with_the_first(compare_result):
    [c] = compare_runs(compare_result["runs"])
    assert (c.improved, c.regressed, c.both_pass) == (1, 1, 1)
    assert json.loads(json.dumps(c.to_dict()))["flips"] == [{"example_id": "three", "class": "improved"},
                                                            {"example_id": "five", "class": "regressed"}]


def test_the_report_is_one_self_contained_html_file(compare_result):
    page = render_report(compare_result)
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 3  # accuracy per run, per tag, latency
    assert not re.search(r"""(src|href)=["']https?://""", page)
    assert "<script" not in page
    assert "matplotlib" in page


def test_the_report_has_metrics_comparison_and_every_example(compare_result):
    page = render_report(compare_result)
    assert "Paired comparison" in page and "sign test p" in page
    for example_id in ("two", "three", "five"):
        assert f"<td>{example_id}</td>" in page
    assert "&lt;b&gt;eleven&lt;/b&gt;" in page and "<b>eleven</b>" not in page  # completions are escaped
    assert "66.7%" in page  # both runs: 2 of 3


def test_a_job_without_runs_still_renders():
    page = render_report({"schema_version": 2, "job_id": "eval-x", "state": "queued", "runs": []})
    assert "no finished runs" in page


def test_cli_report_writes_html_from_a_saved_result(compare_result, tmp_path, capsys):
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(compare_result))
    out = tmp_path / "report.html"
    assert cli_main(["eval", "report", str(saved), "-o", str(out)]) == 0
    assert out.read_text().count("<svg") == 3
    assert "2 run(s)" in capsys.readouterr().out
