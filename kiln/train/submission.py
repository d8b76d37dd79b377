"""Submitting a training request: capacity, planning off the event loop, queueing, the receipt."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kiln.train.manager import TrainingManager
from kiln.train.plan import TrainingPlan


async def submit_training(manager: TrainingManager, req: Any, planner: Callable[..., TrainingPlan], engine: Any,
                          adapters: Any, datasets: Any, suites: Any) -> dict[str, Any]:
    """Plan `req` with `planner` (plan_sft / plan_grpo; every client mistake is a 4xx here) and queue it."""
    manager.check_capacity()
    plan = await asyncio.to_thread(planner, req, engine, adapters, datasets, suites)
    if plan.post_eval is not None and manager.eval_link is not None:
        manager.eval_link.bind_loop(asyncio.get_running_loop())  # where the eval manager runs
    job = manager.submit(plan)
    what = f"{len(plan.work.items)} {'examples' if plan.job_type == 'sft' else 'groups'}"
    # "queued" is the state at submission (§12.1); the worker may already have picked the job up.
    return {"job_id": job.job_id, "state": "queued", "adapter_name": job.adapter_name,
            "message": f"Queued {plan.job_type.upper()} job training adapter `{job.adapter_name}` "
                       f"on {what} ({job.total_steps} steps)"}
