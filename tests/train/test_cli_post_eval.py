"""`kiln train ... --post-eval-suite`: the flags become the request's post_eval block, and following a job
waits while its gate is pending, then prints the outcome and verdict with the documented exit status.
The CLI runs in full (kiln.cli.main) against a real in-process server on a tiny model."""

from __future__ import annotations

import json
import threading
import time

import pytest

import kiln.commands.client as client_module
import kiln.commands.train_follow as train_follow
from kiln.cli import build_parser, main
from kiln.commands.client import ServerClient, ServerError
from kiln.commands.train import build_body
from kiln.commands.train_follow import exit_status
from tests.train.test_post_eval_api import NEVER, TRAIN, suite, tiny_server

ALWAYS = {"kind": "contains", "phrases": [NEVER], "mode": "none"}   # every reply passes, whatever the model says


def parse(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_the_post_eval_flags_become_the_request_block():
    body = build_body(parse("sft", "--dataset", "d", "--post-eval-suite", "held", "--min-accuracy", "0.6",
                            "--relative-recovery", "0.9", "--absolute-gain", "0.05", "--no-auto-load-on-pass",
                            "--post-eval-generation", '{"max_tokens": 8}'), "examples")
    assert body["post_eval"] == {"suite": "held", "min_accuracy": 0.6, "relative_recovery": 0.9,
                                 "absolute_gain": 0.05, "auto_load_on_pass": False, "generation": {"max_tokens": 8}}
    body = build_body(parse("grpo", "--dataset", "g", "--post-eval-suite", "s", "--data-scope", "train-set-eval",
                            "--include-baseline"), "groups")
    assert body["post_eval"] == {"suite": "s", "data_scope": "train-set-eval", "include_baseline": True}
    assert "post_eval" not in build_body(parse("sft", "--dataset", "d"), "examples")


def test_gate_flags_without_a_suite_or_with_bad_json_are_refused():
    with pytest.raises(ServerError, match="--min-accuracy, --include-baseline need.* --post-eval-suite"):
        build_body(parse("sft", "--dataset", "d", "--min-accuracy", "0.5", "--include-baseline"), "examples")
    with pytest.raises(ServerError, match="--post-eval-generation is not valid JSON"):
        build_body(parse("sft", "--dataset", "d", "--post-eval-suite", "s", "--post-eval-generation", "{"), "examples")
    with pytest.raises(SystemExit):
        parse("sft", "--dataset", "d", "--post-eval-suite", "s", "--data-scope", "everything")


@pytest.mark.parametrize(("state", "gate", "plain", "strict"), [
    ("completed", None, 0, 0), ("completed", "promoted", 0, 0), ("completed", "kept", 0, 0),
    ("completed", "inconclusive", 0, 3), ("completed", "regression", 0, 3), ("completed", "demoted", 0, 3),
    ("completed", "error", 1, 1), ("failed", None, 1, 1), ("cancelled", None, 1, 1),
])
def test_exit_status_by_job_state_and_gate_outcome(state, gate, plain, strict):
    status = {"state": state, **({"gate_outcome": gate} if gate else {})}
    assert (exit_status(status), exit_status(status, require_pass=True)) == (plain, strict)


# ---- against a real server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(tmp_path_factory):
    with tiny_server(tmp_path_factory.mktemp("cli-post-eval"), [
            suite("always", 20, ALWAYS), suite("real", 4, {"kind": "exact_match"}),
            {**suite("blocker", 400, ALWAYS), "generation": {"temperature": 0, "max_tokens": 48}}]) as c:
        yield c


@pytest.fixture
def cli(http, monkeypatch, capsys, tmp_path):
    """Run `kiln train ...` through kiln.cli.main against the in-process server: (exit status, stdout, stderr)."""
    def to_app(url: str) -> ServerClient:
        cli_client = ServerClient(url)
        cli_client.http = http
        return cli_client

    monkeypatch.setattr(client_module, "ServerClient", to_app)
    monkeypatch.setattr(train_follow, "POLL_SECONDS", 0.05)
    monkeypatch.setenv("COLUMNS", "250")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in TRAIN))

    def run(*argv: str) -> tuple[int, str, str]:
        argv = tuple(str(data) if a == "TRAIN.jsonl" else a for a in argv)
        code = main(["train", *argv, "--url", "http://testserver"])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


SMALL = ("--epochs", "1", "--rank", "2", "--alpha", "4")


def follow_held(cli, http, job_args: tuple[str, ...], *follow_args: str) -> tuple[str, tuple[int, str, str]]:
    """Submit with --no-follow behind an eval job ahead in the (one-at-a-time) eval queue, then follow with
    `status JOB --follow`; the blocker is cancelled once the post-training eval has been queued behind it
    and following has had time to see it waiting. Returns the job id and the follow's result."""
    blocker = http.post("/v1/eval/run", json={"suite": "blocker"}).json()["job_id"]
    code, out, err = cli(*job_args, "--no-follow")
    assert code == 0, err
    job_id = out.strip()

    def release() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not http.get(f"/v1/train/status/{job_id}").json().get(
                "linked_eval_job_ids"):
            time.sleep(0.05)
        time.sleep(1.0)
        http.delete(f"/v1/eval/jobs/{blocker}")

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        return job_id, cli("status", job_id, "--follow", *follow_args)
    finally:
        releaser.join()


def test_following_waits_while_the_gate_is_pending_then_prints_the_promotion(cli, http):
    job_id, (code, out, err) = follow_held(cli, http, ("sft", "TRAIN.jsonl", "-o", "cli-pass", *SMALL,
                                                       "--post-eval-suite", "always", "--min-accuracy", "0.5",
                                                       "--relative-recovery", "0.8"), "--require-pass")
    status = http.get(f"/v1/train/status/{job_id}").json()
    (eval_id,) = status["linked_eval_job_ids"]
    assert code == 0, err
    assert f"post-training eval: pending (eval job {eval_id})" in err
    assert f"{job_id}: completed - adapter cli-pass" in out and "(now the server default)" in out
    assert f"post-training eval (eval job {eval_id}): promoted" in out
    assert f"verdict: {status['post_eval_verdict']}" in out and "NOT promoted" not in err
    code, out, _ = cli("status")
    row = next(line for line in out.splitlines() if job_id in line)
    assert "promoted" in row


def test_a_gate_that_does_not_pass_is_printed_and_exits_3_only_with_require_pass(cli):
    code, out, err = cli("sft", "TRAIN.jsonl", "-o", "cli-few", *SMALL, "--post-eval-suite", "real", "--require-pass")
    assert code == 3, out + err
    assert "): inconclusive" in out and "verdict: inconclusive" in out
    assert "adapter cli-few was NOT promoted (gate outcome inconclusive)" in err
    job_id = out.split(":", 1)[0]
    assert cli("status", job_id, "--follow")[0] == 0
    code, out, _ = cli("status", job_id)
    assert code == 0 and json.loads(out)["gate_outcome"] == "inconclusive"


def test_a_train_set_eval_is_followed_until_its_report(cli, http):
    _, (code, out, err) = follow_held(cli, http, ("sft", "TRAIN.jsonl", "-o", "cli-report", *SMALL,
                                                  "--post-eval-suite", "real", "--data-scope", "train-set-eval"),
                                      "--json")
    assert code == 0, err
    detail = json.loads(out)
    assert detail["post_eval"]["data_scope"] == "train-set-eval" and "gate_outcome" not in detail
    assert detail["post_eval_verdict"].startswith("report only (train-set-eval): ")
    assert len(detail["linked_eval_job_ids"]) == 1


def test_a_refused_post_eval_is_a_client_error(cli):
    code, _, err = cli("sft", "TRAIN.jsonl", "-o", "cli-bad", *SMALL, "--post-eval-suite", "real",
                        "--data-scope", "train-set-eval", "--min-accuracy", "0.5")
    assert code == 1 and "error 400 [training_invalid_request]" in err and "gates nothing" in err
