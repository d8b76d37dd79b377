"""Training routes (semantics.md §1.4, §12): SFT and GRPO jobs, status, queue, cancel.

Services (built by `init` unless a test put its own first):
  state.services["training"]   TrainingManager (records under <data_dir>/train/jobs)
Also used: state.services["adapter_store"], ["adapters_active"] (the adapter routes build them),
["datasets"] (the dataset routes build it), and ["eval_suites"] / ["eval_jobs"] (the eval routes build
them; registered first) for `post_eval`: the training manager queues post-training eval jobs through
the eval job manager and listens for their end to resolve the gate (semantics.md §8.14).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.store import AdapterStore
from kiln.api.errors import parse_model, read_json_body
from kiln.api.state import ServerState, get_state
from kiln.errors import KilnError
from kiln.train.errors import CODE, PREFIX
from kiln.train.eval_link import EvalLink
from kiln.train.executor import JobContext
from kiln.train.job_store import TrainJobStore, job_root
from kiln.train.manager import TrainingManager
from kiln.train.plan import TrainingPlan, plan_grpo, plan_sft
from kiln.train.requests import GrpoRequest, SftRequest

router = APIRouter(tags=["training"])

SERVICE = "training"
MAX_BODY_BYTES = 64 * 1024 * 1024


def _model_loading() -> KilnError:
    return KilnError(503, "model_loading", "the model is still loading", hint="Retry when GET /health answers 200.",
                     headers={"Retry-After": "5"})


def _context(state: ServerState):
    def context() -> JobContext:
        if state.engine is None:
            raise _model_loading()
        return JobContext(state.engine, state.services["adapter_store"], state.services.get("adapters_active"))

    return context


def init(state: ServerState) -> None:
    if SERVICE in state.services:
        return
    store = state.services.setdefault("adapter_store", AdapterStore(state.settings.adapter_dir))
    state.services.setdefault("adapters_active", ActiveAdapter(store))
    training = state.settings.training
    eval_jobs = state.services.get("eval_jobs")
    manager = TrainingManager(TrainJobStore(job_root(state.settings.data.data_dir)), _context(state),
                              max_queued_jobs=training.max_queued_jobs, max_tracked_jobs=training.max_tracked_jobs,
                              webhook_url=getattr(training, "webhook_url", None),
                              eval_link=EvalLink(eval_jobs) if eval_jobs is not None else None)
    manager.load_archived()
    if eval_jobs is not None:
        eval_jobs.listeners.append(manager.on_eval_finished)
    state.services[SERVICE] = manager


def _manager(request: Request) -> TrainingManager:
    return get_state(request).services[SERVICE]


async def _body(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise KilnError(413, CODE, f"{PREFIX}request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                        hint="Upload the rows as a dataset and train from it by name.")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise KilnError(413, CODE, f"{PREFIX}request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                        hint="Upload the rows as a dataset and train from it by name.")
    return await read_json_body(request, code=CODE, prefix=PREFIX)


async def _submit(request: Request, model: type[BaseModel], planner) -> JSONResponse:
    state = get_state(request)
    manager = _manager(request)
    req = parse_model(model, await _body(request), code=CODE, prefix=PREFIX)
    engine = state.engine
    if engine is None:
        raise _model_loading()
    manager.check_capacity()
    plan: TrainingPlan = await run_in_threadpool(planner, req, engine, state.services["adapter_store"],
                                                 state.services.get("datasets"), state.services.get("eval_suites"))
    if plan.post_eval is not None and manager.eval_link is not None:
        manager.eval_link.bind_loop(asyncio.get_running_loop())  # where the eval manager runs
    job = manager.submit(plan)
    what = f"{len(plan.work.items)} {'examples' if plan.job_type == 'sft' else 'groups'}"
    # "queued" is the state at submission (§12.1); the worker may already have picked the job up.
    return JSONResponse({"job_id": job.job_id, "state": "queued", "adapter_name": job.adapter_name,
                         "message": f"Queued {plan.job_type.upper()} job training adapter `{job.adapter_name}` "
                                    f"on {what} ({job.total_steps} steps)"})


@router.post("/v1/train/sft")
async def train_sft(request: Request) -> JSONResponse:
    return await _submit(request, SftRequest, plan_sft)


@router.post("/v1/train/grpo")
@router.post("/v1/training/grpo", include_in_schema=False)
async def train_grpo(request: Request) -> JSONResponse:
    return await _submit(request, GrpoRequest, plan_grpo)


@router.get("/v1/train/status")
async def list_status(request: Request) -> JSONResponse:
    return JSONResponse([job.status() for job in _manager(request).list()])


@router.get("/v1/train/status/{job_id}")
async def job_status(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(_manager(request).get(job_id).status())


@router.get("/v1/train/jobs/{job_id}")
async def job_detail(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(_manager(request).get(job_id).detail())


@router.delete("/v1/train/jobs/{job_id}")
async def cancel_or_delete_job(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(_manager(request).cancel_or_delete, job_id))


@router.get("/v1/train/queue")
async def queue(request: Request) -> JSONResponse:
    return JSONResponse(_manager(request).queue_view())


@router.delete("/v1/train/queue/{job_id}")
async def cancel_queued(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(await run_in_threadpool(_manager(request).cancel_queued, job_id))
