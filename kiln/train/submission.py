"""Submitting a training request: capacity, planning off the event loop, queueing, the receipt; and
resuming an interrupted job from the request it kept."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.train.distill_plan import plan_opd, plan_self_distill
from kiln.train.jobs import TrainJob
from kiln.train.manager import TrainingManager
from kiln.train.plan import TrainingPlan, plan_dpo, plan_grpo, plan_sft
from kiln.train.requests import DpoRequest, GrpoRequest, OpdRequest, SelfDistillRequest, SftRequest

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

log = logging.getLogger("kiln.train")

PLANNERS: dict[str, tuple[type, Callable[..., TrainingPlan]]] = {
    "sft": (SftRequest, plan_sft), "grpo": (GrpoRequest, plan_grpo), "dpo": (DpoRequest, plan_dpo),
    "opd": (OpdRequest, plan_opd), "distill": (SelfDistillRequest, plan_self_distill)}
ITEMS = {"sft": "examples", "grpo": "groups", "dpo": "pairs", "opd": "completions", "distill": "completions"}


async def submit_training(manager: TrainingManager, req: Any, planner: Callable[..., TrainingPlan], engine: EngineView,
                          adapters: Any, datasets: Any, suites: Any, *,
                          request_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plan `req` with `planner` (plan_sft / plan_grpo; every client mistake is a 4xx here) and queue it.
    `request_body` (the wire body) is kept beside the job's checkpoints so a resume can plan it again."""
    manager.check_capacity()
    plan = await asyncio.to_thread(planner, req, engine, adapters, datasets, suites)
    if plan.post_eval is not None and manager.eval_link is not None:
        manager.eval_link.bind_loop(asyncio.get_running_loop())  # where the eval manager runs
    job = await asyncio.to_thread(manager.submit, plan, request_body)
    what = f"{len(plan.work.items)} {ITEMS[plan.job_type]}"
    # "queued" is the state at submission (§12.1); the worker may already have picked the job up.
    return {"job_id": job.job_id, "state": "queued", "adapter_name": job.adapter_name,
            "message": f"Queued {plan.job_type.upper()} job training adapter `{job.adapter_name}` "
                       f"on {what} ({job.total_steps} steps)"}


def resume_job(manager: TrainingManager, job_id: str, engine: EngineView, adapters: Any, datasets: Any,
               suites: Any, judgments: Any = None, teachers: Any = None) -> TrainJob:
    """Plan an interrupted job again from its kept request (same job id, same output name) and queue it;
    the executor continues from its latest checkpoint. Blocking: planning tokenizes. `judgments` (the
    judgment store) is what a DPO job trained from a judgment set reads again; `teachers` (the teacher
    registry) what an OPD job resolves its teacher from again."""
    job, job_type, body = manager.resume_request(job_id)
    model, planner = PLANNERS[job_type]
    try:
        req = model.model_validate(body)
    except ValidationError as e:  # accepted once; a later version may read it differently
        raise KilnError(409, "training_job_not_resumable", f"the kept request of job {job_id} no longer validates: "
                        f"{e.errors()[0].get('msg') if e.errors() else e}", param="job_id",
                        hint="Submit the job again.") from None
    extra = {"dpo": {"judgments": judgments}, "opd": {"teachers": teachers}}.get(job_type, {})
    plan = planner(req, engine, adapters, datasets, suites, job_id=job.job_id, **extra)
    return manager.resume(plan)


async def resume_training(manager: TrainingManager, job_id: str, engine: EngineView, adapters: Any, datasets: Any,
                          suites: Any, judgments: Any = None, teachers: Any = None) -> dict[str, Any]:
    """POST /v1/train/jobs/{id}/resume."""
    if manager.eval_link is not None:
        manager.eval_link.bind_loop(asyncio.get_running_loop())
    job = await asyncio.to_thread(resume_job, manager, job_id, engine, adapters, datasets, suites, judgments,
                                  teachers)
    step = (job.checkpoint or {}).get("step", 0)
    return {"job_id": job.job_id, "state": "queued", "adapter_name": job.adapter_name, "resume_from_step": step,
            "message": f"Resuming {job.job_type.upper()} job {job.job_id} from step {step} of {job.total_steps}"}


def resume_interrupted(manager: TrainingManager, engine: EngineView, adapters: Any, datasets: Any,
                       suites: Any, judgments: Any = None, teachers: Any = None) -> list[str]:
    """[training] auto_resume at start: resume every interrupted job; returns the ids resumed."""
    resumed = []
    for job in manager.interrupted_jobs():
        try:
            resume_job(manager, job.job_id, engine, adapters, datasets, suites, judgments, teachers)
            resumed.append(job.job_id)
        except KilnError as e:
            log.warning("training job %s not resumed at start: %s", job.job_id, e.message)
    return resumed
