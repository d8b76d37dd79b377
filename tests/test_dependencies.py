"""Runtime dependencies are what serving needs; test and report tools live in extras."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_test_and_report_libraries_are_not_runtime_dependencies():
    runtime = _names(PROJECT["dependencies"])
    assert not runtime & {"jsonschema", "referencing", "matplotlib", "lm-eval", "schemathesis", "pytest"}
    extras = PROJECT["optional-dependencies"]
    assert "matplotlib" in _names(extras["reports"])
    assert {"jsonschema", "referencing", "lm-eval", "schemathesis", "kiln"} <= _names(extras["dev"])


def test_the_serving_stack_imports_none_of_them():
    code = ("import sys, kiln.cli, kiln.api.app, kiln.engine.serving, kiln.commands.serve, kiln.commands.eval\n"
            "kiln.cli.build_parser()\n"
            "print(sorted(m for m in ('jsonschema', 'referencing', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_report_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from kiln.evals import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(report.ReportDependencyError, match=r"kiln\[reports\]"):
        report.render_report({"runs": []})
    result = tmp_path / "r.json"
    result.write_text('{"job_id": "x", "runs": []}')
    from kiln.cli import main

    assert main(["eval", "report", str(result), "-o", str(tmp_path / "r.html")]) == 1
    assert "pip install 'kiln[reports]'" in capsys.readouterr().err
