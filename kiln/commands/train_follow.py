"""Following a training job from the CLI: the progress bar while it trains, then its post-training eval
(semantics.md §8.14) while the gate is "pending", then the report and the exit status.

Exit status: 0 when the job completed and its gate, if any, decided (promoted, kept, regression, demoted or
inconclusive: a gate that rejects the adapter did its job, and says so on stderr); 1 when the job failed or
was cancelled, or the gate ended "error" (the eval could not decide); with --require-pass, 3 when a gate
decided regression, demoted or inconclusive.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kiln.commands.client import ServerClient, ServerError, path_segment

POLL_SECONDS = 0.5
TERMINAL = ("completed", "failed", "cancelled")
PENDING = "pending"
PASSED = ("promoted", "kept")
NOT_PASSED_EXIT = 3
# An ungated (train-set-eval) report is written just after its eval job ends; if it never comes (the
# server restarted in between) following stops after this many polls.
REPORT_GRACE_POLLS = 20

EXIT_HELP = ("exit status: 0 when the job completed and its post-training gate (if any) decided - promoted, kept, "
             "regression, demoted or inconclusive (a rejection is printed, not an error); 1 when the job failed or "
             "was cancelled or the gate ended \"error\"; with --require-pass, 3 when the gate did not pass")



def follow(client: ServerClient, job_id: str) -> dict[str, Any]:
    """Poll until the job ends and its post-training eval (if any) has been decided; return the last status."""
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(job_id, total=None, loss="-", speed="")
        status = _follow_training(client, job_id, progress, task, console)
        if status["state"] == "completed":
            status = _follow_post_eval(client, job_id, status, progress, task, console)
    return status


def _follow_training(client: ServerClient, job_id: str, progress: Progress, task: TaskID,
                     console: Console) -> dict[str, Any]:
    """Ctrl-C cancels the job and keeps following; a second Ctrl-C stops waiting."""
    cancelled = False
    while True:
        try:
            status = client.get(f"/v1/train/status/{path_segment(job_id)}")
            if status["state"] in TERMINAL:
                return status
            loss, speed = status.get("current_loss"), status.get("tokens_per_sec")
            progress.update(task, description=f"{status['adapter_name']} {status['state']}",
                            total=status.get("total_steps") or None, completed=status.get("step", 0),
                            loss="-" if loss is None else f"{loss:.4f}",
                            speed="" if speed is None else f"{speed:.0f} tok/s")
            time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            if cancelled:
                raise
            cancelled = True
            # DELETE on a job that ended meanwhile would forget it, so look first.
            if client.get(f"/v1/train/status/{path_segment(job_id)}")["state"] not in TERMINAL:
                console.print(f"cancelling {job_id} (Ctrl-C again to stop waiting)")
                client.delete(f"/v1/train/jobs/{path_segment(job_id)}")


def _decided(status: dict[str, Any], gated: bool) -> bool:
    if gated:
        return status.get("gate_outcome") not in (None, PENDING)
    return status.get("post_eval_verdict") is not None


def _follow_post_eval(client: ServerClient, job_id: str, status: dict[str, Any], progress: Progress,
                      task: TaskID, console: Console) -> dict[str, Any]:
    """Wait while the gate is pending (or an ungated report has not arrived), showing the eval's progress."""
    post_eval = client.get(f"/v1/train/jobs/{path_segment(job_id)}").get("post_eval")
    if not post_eval:
        return status
    # The job may read "completed" a moment before its gate reads "pending": the request block decides.
    gated = bool(post_eval.get("gate_policy"))
    announced, grace = None, 0
    try:
        while not _decided(status, gated):
            eval_id = (status.get("linked_eval_job_ids") or [None])[-1]
            ended = eval_id is None
            if eval_id is not None:
                if eval_id != announced:
                    console.print(f"post-training eval: pending (eval job {eval_id})")
                    announced = eval_id
                ended = _show_eval(client, eval_id, progress, task)
            grace = grace + 1 if ended and not gated else 0
            if grace > REPORT_GRACE_POLLS:
                break
            time.sleep(POLL_SECONDS)
            status = client.get(f"/v1/train/status/{path_segment(job_id)}")
    except KeyboardInterrupt:
        # Cancelling is over: the adapter is trained and the gate decides on its own.
        console.print(f"stopped following; the post-training eval goes on: kiln train status {job_id} --follow")
        raise
    return status


def _show_eval(client: ServerClient, eval_id: str, progress: Progress, task: TaskID) -> bool:
    """Draw the eval job's progress; True once it has ended (or is gone)."""
    try:
        ev = client.get(f"/v1/eval/jobs/{path_segment(eval_id)}")
    except ServerError as e:
        if e.status == 404:
            return True
        raise
    done = ev.get("progress") or {}
    progress.update(task, description=f"post-training eval {eval_id} ({len(ev.get('runs') or [])} run(s) done)",
                    total=done.get("examples_total") or None, completed=done.get("examples_completed", 0),
                    loss="-", speed="")
    return ev.get("state") in TERMINAL


def exit_status(status: dict[str, Any], require_pass: bool = False) -> int:
    gate = status.get("gate_outcome")
    if status["state"] != "completed" or gate == "error":
        return 1
    if require_pass and gate not in (None, *PASSED):
        return NOT_PASSED_EXIT
    return 0


def report(status: dict[str, Any], *, as_json: bool, client: ServerClient, require_pass: bool = False) -> int:
    """Print the final job (a line, or its detail as JSON) and its post-training eval; return the exit status."""
    if as_json:
        print(json.dumps(client.get(f"/v1/train/jobs/{path_segment(status['job_id'])}"), indent=2))
        return exit_status(status, require_pass)
    line = f"{status['job_id']}: {status['state']} - adapter {status['adapter_name']}"
    if status.get("current_loss") is not None:
        line += f", final loss {status['current_loss']:.4f}"
    line += f", {status.get('elapsed_secs', 0):.1f}s"
    if status.get("activated"):
        line += " (now the server default)"
    print(line)
    held = status.get("held_out")
    if held:  # DPO: the held-out pairs, the new adapter against the one the job started from
        print(f"held-out pairs ({held['pairs']}): preference accuracy {held['preference_accuracy_before']:.3f} -> "
              f"{held['preference_accuracy_after']:.3f}, mean log-prob margin {held['mean_logprob_margin_before']:.3f} "
              f"-> {held['mean_logprob_margin_after']:.3f}, win rate against the start {held['win_rate_vs_start']:.3f}")
    for key in ("error", "activation_error"):
        if status.get(key):
            print(f"{key.replace('_', ' ')}: {status[key]}", file=sys.stderr)
    gate, verdict = status.get("gate_outcome"), status.get("post_eval_verdict")
    if gate is not None or verdict is not None:
        eval_ids = status.get("linked_eval_job_ids") or []
        via = f" (eval job {eval_ids[-1]})" if eval_ids else ""
        print(f"post-training eval{via}: {gate or 'report only'}")
        if verdict:
            print(f"verdict: {verdict}")
        if gate not in (None, PENDING, *PASSED):
            print(f"adapter {status['adapter_name']} was NOT promoted (gate outcome {gate})", file=sys.stderr)
    return exit_status(status, require_pass)
