"""Queue a training job's post-training eval through the server's eval job manager (semantics.md §8.14).

The eval manager lives on the server's event loop; training finishes on its own thread, so the job is
handed over with `run_coroutine_threadsafe` on the loop the training request arrived on. The eval job
has submission_kind "post_training", names its training job, carries the PostEvalGate when gated, and
runs the baseline first and the candidate second (one SuiteResult each, paired by example id).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.errors import KilnError
from kiln.evals.jobs import EvalJob, new_job_id
from kiln.evals.seeds import effective_job_seed
from kiln.train.post_eval import PostEvalPlan

SUBMIT_TIMEOUT_SECS = 30.0


def gate_record(plan: PostEvalPlan, adapter_name: str, training_job_id: str) -> dict[str, Any] | None:
    """The PostEvalGate object (evals-api PostEvalGate) for a gated plan, None otherwise."""
    if plan.gate is None:
        return None
    return {**plan.gate.to_dict(), "adapter_name": adapter_name, "training_job_id": training_job_id,
            "auto_load_on_pass": plan.gate.auto_load_on_pass}


def build_eval_job(plan: PostEvalPlan, adapter_name: str, training_job_id: str, baseline: str | None) -> EvalJob:
    gen_seed = plan.generation.seed if plan.generation is not None else None
    seed = effective_job_seed(gen_seed, plan.suite.generation.seed)
    adapters = [baseline, adapter_name] if plan.include_baseline else [adapter_name]
    job = EvalJob(new_job_id(), plan.suite, adapters, "post_training", seed, plan.generation)
    job.source_training_job_id = training_job_id
    job.post_eval_gate = gate_record(plan, adapter_name, training_job_id)
    return job


class EvalLink:
    """What the training manager needs from the eval side: a manager, and the loop it runs on."""

    def __init__(self, eval_jobs: Any) -> None:
        self.eval_jobs = eval_jobs   # EvalJobManager
        self.loop: asyncio.AbstractEventLoop | None = None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called by each training submission from the server's loop."""
        self.loop = loop

    def submit(self, job: EvalJob) -> EvalJob:
        """Queue `job` from any thread; raises KilnError when it cannot be queued."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            raise KilnError(503, "eval_registry_unavailable", "the server's eval worker is not running")
        for adapter in dict.fromkeys(job.adapters):
            self.eval_jobs.ctx.resolve_target(adapter)  # both runs' adapters must exist now

        async def queue() -> EvalJob:
            self.eval_jobs.generator()  # 503 while no model can generate
            self.eval_jobs.submit(job)
            self.eval_jobs.start_worker()
            return job

        return asyncio.run_coroutine_threadsafe(queue(), loop).result(timeout=SUBMIT_TIMEOUT_SECS)
