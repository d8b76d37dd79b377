"""Read a finished post-training eval job, decide, and act on the training job's adapter (semantics.md §8.14).

promoted   -> the adapter is hot-swapped in and becomes the default (the path auto_load uses);
kept       -> passed, left on disk, not activated (auto_load_on_pass false);
demoted    -> removed from serving: unloaded if active, its folder renamed "<name>.failed";
regression, inconclusive -> left on disk, not activated;
error      -> anything that went wrong (eval not completed, runs missing, unsound evidence, the adapter
              changed since training, swap or rename failure): nothing is activated (fail closed).
Every path records gate_outcome, post_eval_verdict and post_eval_gate_evidence on the training job.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from kiln.errors import KilnError
from kiln.evals.gate import GateDecision, GateThresholds, error_decision, gate_from_runs
from kiln.evals.jobs import EvalJob
from kiln.store.atomic import fsync_path
from kiln.train.executor import JobContext, activate
from kiln.train.jobs import TrainJob

log = logging.getLogger("kiln.train")

PENDING = "pending"
FAILED_SUFFIX = ".failed"


def is_gated(job: TrainJob) -> bool:
    return bool(job.post_eval and job.post_eval.get("gate_policy"))


def thresholds_of(job: TrainJob) -> GateThresholds:
    pe = job.post_eval or {}
    return GateThresholds(float(pe.get("min_accuracy", 0.0)), pe.get("relative_recovery"), pe.get("absolute_gain"),
                          bool(pe.get("auto_load_on_pass", True)))


def record(job: TrainJob, decision: GateDecision) -> None:
    # The outcome last: a reader that sees it resolved also sees its verdict and evidence.
    job.post_eval_gate_evidence, job.post_eval_verdict = decision.evidence, decision.verdict
    job.gate_outcome = decision.outcome


def decide_for(job: TrainJob, eval_job: EvalJob) -> GateDecision:
    """The gate over a terminal eval job; an eval that did not complete is an error."""
    link = {"eval_job_id": eval_job.job_id, "suite": eval_job.suite.name,
            "suite_hash": (job.post_eval or {}).get("suite_hash")}
    if eval_job.state != "completed":
        why = f": {eval_job.error}" if eval_job.error else ""
        return error_decision(f"the post-training eval job {eval_job.job_id} ended {eval_job.state}{why}", link)
    decision = gate_from_runs(eval_job.runs, job.adapter_name, thresholds_of(job))
    decision.evidence.update(link)
    return decision


def demote_adapter(name: str, ctx: JobContext) -> Path:
    """Take the adapter out of serving and rename its folder to "<name>.failed" (an older one is replaced)."""
    store = ctx.adapters
    path = store.require(name)
    dest = path.with_name(name + FAILED_SUFFIX)
    lock = ctx.active.lock if ctx.active is not None else None
    if lock is not None:
        lock.acquire()
    try:
        if ctx.active is not None and ctx.active.name == name:
            ctx.active.unload()
        trash = None
        if dest.exists():
            trash = dest.with_name(f".trash-{uuid.uuid4().hex}")
            os.rename(dest, trash)
        os.rename(path, dest)
        fsync_path(path.parent)
    finally:
        if lock is not None:
            lock.release()
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return dest


def _act(job: TrainJob, decision: GateDecision, context: Callable[[], JobContext]) -> GateDecision:
    """Carry out the outcome; a failure turns it into an error, keeping the numbers."""
    if decision.outcome == "error":
        return decision
    try:
        if decision.outcome == "promoted":
            ctx = context()
            trained = (job.train_receipt or {}).get("adapter_content_sha256")
            now = ctx.adapters.content_hash(job.adapter_name)
            if trained is not None and now != trained:
                raise KilnError(409, "adapter_changed", f"adapter {job.adapter_name!r} changed on disk after training "
                                f"({now} != {trained})")
            activate(job, job.adapter_name, ctx)
            if not job.activated:
                raise KilnError(500, "adapter_load_failed", f"activation failed: {job.activation_error}")
            decision.evidence["action"] = "activated"
            return GateDecision(decision.outcome, f"{decision.verdict} Adapter {job.adapter_name!r} is now active.",
                                decision.evidence)
        if decision.outcome == "demoted":
            dest = demote_adapter(job.adapter_name, context())
            job.adapter_path = str(dest)
            decision.evidence.update(action="renamed", demoted_path=str(dest))
            return GateDecision(decision.outcome, f"{decision.verdict} Adapter folder renamed to {dest.name!r}; "
                                "it is not served.", decision.evidence)
    except (KilnError, OSError) as e:
        message = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
        log.warning("training job %s: gate outcome %s could not be applied: %s", job.job_id, decision.outcome, message)
        return error_decision(f"{decision.outcome} could not be applied: {message}",
                              {**decision.evidence, "failed_outcome": decision.outcome})
    decision.evidence["action"] = "none"
    return GateDecision(decision.outcome, f"{decision.verdict} Adapter {job.adapter_name!r} was left on disk, not "
                        "activated.", decision.evidence)


def resolve_gate(job: TrainJob, eval_job: EvalJob, context: Callable[[], JobContext]) -> None:
    """Decide and act for a gated job; never raises."""
    try:
        record(job, _act(job, decide_for(job, eval_job), context))
    except Exception as e:  # noqa: BLE001 - whatever broke, the gate fails closed
        log.exception("training job %s: gate failed", job.job_id)
        record(job, error_decision(f"{type(e).__name__}: {e}", {"eval_job_id": eval_job.job_id}))


def report(job: TrainJob, eval_job: EvalJob) -> None:
    """An ungated (train-set-eval) post-eval: a prose summary only; no gate outcome."""
    if eval_job.state != "completed":
        job.post_eval_verdict = f"report only: eval job {eval_job.job_id} ended {eval_job.state}"
        return
    parts = []
    for run in eval_job.runs:
        m = run.get("metrics", {})
        who = "candidate" if run.get("adapter") == job.adapter_name else f"baseline {run.get('adapter') or '<base>'}"
        parts.append(f"{who} accuracy {m.get('accuracy', 0.0):.3f} on {m.get('num_examples', 0)} example(s)")
    job.post_eval_verdict = f"report only ({(job.post_eval or {}).get('data_scope')}): " + "; ".join(parts)


def interrupted(job: TrainJob) -> None:
    """A gate still pending when the server stopped: it will never resolve, so it is an error."""
    record(job, error_decision("the server stopped before the post-training gate resolved",
                               {"linked_eval_job_ids": list(job.linked_eval_job_ids)}))


def submission_failed(job: TrainJob, e: BaseException) -> None:
    message = e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}"
    if is_gated(job):
        record(job, error_decision(f"the post-training eval could not be queued: {message}"))
    else:
        job.post_eval_verdict = f"report only: the post-training eval could not be queued: {message}"


def mark_pending(job: TrainJob) -> None:
    job.gate_outcome = PENDING
    job.post_eval_verdict = ("pending: the post-training eval runs the baseline and the candidate; the previously "
                             "active adapter stays active until the gate decides")
