"""Eval jobs end to end on a tiny model: a real `kiln serve`, its HTTP API and the `kiln eval` CLI.

One suite is run, replayed, re-run and compared on the shared tiny server; a long inline suite is
cancelled mid-run; the same seeded suite is run again through the remote (OpenAI-compatible)
generator against a second server on another loopback port, which must reproduce the bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kiln.testing.schemas import validate
from tests.e2e.conftest import RunningServer, start_server, stop_server

pytestmark = pytest.mark.e2e
SCHEMA = "kiln-evals-v1.schema.json"
TERMINAL = ("completed", "failed", "cancelled")
PROMPTS = ["Tell me a story.", "What is 2 + 2?", "Name a colour.", "Hello!", "Where is Paris?", "Count to ten."]


def suite(name: str, n: int = len(PROMPTS), max_tokens: int = 16) -> dict:
    return {
        "name": name, "schema_version": 2,
        "default_scorer": {"kind": "regex", "pattern": "[Tt]he|[aeiou]{2}"},
        "generation": {"max_tokens": max_tokens, "temperature": 0.8},
        "examples": [{"id": f"ex{i}", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" #{i}"}],
                      "tags": ["even" if i % 2 == 0 else "odd"]} for i in range(n)],
    }


def api(server: RunningServer, method: str, path: str, **kw) -> dict:
    resp = httpx.request(method, server.url + path, timeout=60, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


def submit(server: RunningServer, path: str, body: dict) -> str:
    receipt = api(server, "POST", path, json=body)
    validate(SCHEMA, "EvalRunResponse", receipt)
    return receipt["job_id"]


def info_of(server: RunningServer, job_id: str) -> dict:
    listing = api(server, "GET", "/v1/eval/jobs")
    validate(SCHEMA, "EvalJobListResponse", listing)
    return next(j for j in listing["jobs"] if j["job_id"] == job_id)


def wait_done(server: RunningServer, job_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = info_of(server, job_id)
        if info["state"] in TERMINAL and info["finished_at_iso"] is not None:
            result = api(server, "GET", f"/v1/eval/jobs/{job_id}")
            validate(SCHEMA, "EvalResult", result)
            return result
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def raw_texts(result: dict, run: int = 0) -> dict[str, str]:
    return {o["example_id"]: o["raw_completion_text"] for o in result["runs"][run]["outcomes"]}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "eval", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def second_server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    server = start_server(str(tiny_model_dir), tmp_path_factory.mktemp("srv-b"), "--served-model-id", "tiny")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def seeded_job(tiny_server) -> dict:
    validate(SCHEMA, "SuiteSaveResponse", api(tiny_server, "POST", "/v1/eval/suites?force=true", json=suite("e2e")))
    job_id = submit(tiny_server, "/v1/eval/run", {"suite": "e2e", "seed": 7})
    return wait_done(tiny_server, job_id)


def test_a_seeded_run_completes_with_every_example_scored(tiny_server, seeded_job):
    run = seeded_job["runs"][0]
    assert seeded_job["state"] == "completed" and seeded_job["effective_seed"] == "7"
    assert run["metrics"]["num_examples"] == len(PROMPTS) and len(run["outcomes"]) == len(PROMPTS)
    assert set(run["metrics"]["tag_breakdown"]) == {"even", "odd"}
    archive = tiny_server.log_path.parent / "data" / "eval" / "jobs" / f"{seeded_job['job_id']}.json"
    assert json.loads(archive.read_text())["result"] == seeded_job


def test_a_seeded_run_replayed_on_the_same_server_matches(tiny_server, seeded_job):
    job_id = submit(tiny_server, f"/v1/eval/jobs/{seeded_job['job_id']}/replay", {"run_index": 0})
    result = wait_done(tiny_server, job_id)
    assert result["replay_verdict"]["status"] == "matched", result["replay_verdict"]
    assert raw_texts(result) == raw_texts(seeded_job)


def test_rerun_reproduces_the_selected_examples(tiny_server, seeded_job):
    body = {"outcome_kinds": ["pass", "fail", "invalid", "error"]}
    result = wait_done(tiny_server, submit(tiny_server, f"/v1/eval/jobs/{seeded_job['job_id']}/rerun", body))
    assert result["state"] == "completed"
    assert raw_texts(result) == raw_texts(seeded_job)


def test_compare_base_against_itself_has_no_flips(tiny_server, seeded_job):
    from kiln.evals.compare import compare_runs

    job_id = submit(tiny_server, "/v1/eval/compare", {"suite": "e2e", "adapters": ["", ""], "seed": 7})
    result = wait_done(tiny_server, job_id)
    assert [r["adapter"] for r in result["runs"]] == [None, None]
    assert raw_texts(result, 0) == raw_texts(result, 1) == raw_texts(seeded_job)
    [c] = compare_runs(result["runs"])
    assert (c.improved, c.regressed, c.p_value) == (0, 0, 1.0)


def test_cancelling_a_running_job_keeps_its_finished_examples(tiny_server):
    job_id = submit(tiny_server, "/v1/eval/run", {"inline_suite": suite("e2e-long", n=48, max_tokens=256), "seed": 1})
    deadline = time.monotonic() + 30
    while True:
        info = info_of(tiny_server, job_id)
        validate(SCHEMA, "EvalJobInfo", info)
        if info["state"] == "running" and info["progress"]["examples_completed"] >= 1:
            break
        assert info["state"] in ("queued", "running") and time.monotonic() < deadline, info
        time.sleep(0.02)
    answer = api(tiny_server, "DELETE", f"/v1/eval/jobs/{job_id}")
    validate(SCHEMA, "CancelEvalJobResponse", answer)
    assert answer["status"] == "cancelling"
    result = wait_done(tiny_server, job_id)
    assert result["state"] == "cancelled"
    kept = result["runs"][0]["outcomes"]
    assert 1 <= len(kept) < 48
    deleted = api(tiny_server, "DELETE", f"/v1/eval/jobs/{job_id}")
    assert deleted == {"status": "deleted", "job_id": job_id, "removed_archive_file": True}


def test_the_remote_generator_reproduces_the_run_on_a_second_server(tiny_server, second_server, seeded_job, tmp_path):
    (tmp_path / "suite.json").write_text(json.dumps(suite("e2e")))
    out = cli("run", "suite.json", "--base-url", second_server.base_url, "--seed", "7", "--save", "remote.json",
              "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    remote = json.loads((tmp_path / "remote.json").read_text())
    validate(SCHEMA, "EvalResult", remote)
    assert raw_texts(remote) == raw_texts(seeded_job)
    assert remote["runs"][0]["metrics"]["accuracy"] == seeded_job["runs"][0]["metrics"]["accuracy"]


def test_cli_runs_follows_and_reports_a_server_job(tiny_server, tmp_path):
    (tmp_path / "suite.json").write_text(json.dumps(suite("e2e-cli", n=3)))
    out = cli("run", "suite.json", "--url", tiny_server.url, "--seed", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "completed" in out.stdout and "Runs" in out.stdout
    job_id = out.stderr.split("job ", 1)[1].split()[0]
    listing = cli("jobs", "--url", tiny_server.url, cwd=tmp_path)
    assert job_id in listing.stdout
    report = cli("report", job_id, "--url", tiny_server.url, "-o", "report.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "report.html").read_text().count("<svg") == 3
