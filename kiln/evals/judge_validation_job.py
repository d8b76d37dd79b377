"""Queueing a judge's held-out validation (semantics.md §11.4): the `judge-validate-<name>` suite, run
inline against the judge adapter through the eval job manager."""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.data.judge_validation import ValidationPlan, plan_validation
from kiln.data.judgment_rows import JudgmentRow
from kiln.data.judgments import JudgmentStore
from kiln.evals.intake import job_for_run
from kiln.evals.requests import RunRequest
from kiln.evals.suite import parse_suite


def validation_plan(store: JudgmentStore, name: str, holdout_n: int | None) -> ValidationPlan:
    manifest = store.get(name)  # 404 before anything else
    rows = [JudgmentRow.from_json(r) for r in store.rows(name)]
    return plan_validation(name, rows, holdout_n=holdout_n, last_compiled_split=manifest.get("last_compiled_split"))


async def queue_judge_validation(jobs: Any, store: JudgmentStore, name: str, adapter: str,
                                 holdout_n: int | None) -> dict[str, Any]:
    plan = await asyncio.to_thread(validation_plan, store, name, holdout_n)
    # Inline, like POST /v1/eval/run with inline_suite: nothing is registered, so a user's suite of the
    # same name is never overwritten and the job carries the exact suite it scored.
    job = job_for_run(jobs.ctx, RunRequest(inline_suite=parse_suite(plan.suite), adapter=adapter))
    jobs.generator()  # 503 while the model loads
    jobs.start_worker()
    job = jobs.submit(job)
    return {"status": "queued", "eval_job_id": job.job_id, "effective_seed": str(job.effective_seed),
            "validation_suite": plan.suite_name, "warnings": plan.warnings}
