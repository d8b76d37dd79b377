"""Training routes (semantics.md §1.4, §12): SFT, GRPO, DPO, OPD and self-distillation jobs, status, queue,
cancel, resume.

Services (built by kiln.server.build_server):
  state.services.training   TrainingManager (records under <data_dir>/train/jobs)
Also used: state.services.adapter_store, .adapters_active, .datasets, .judgments (DPO from a judgment
set), .teachers (OPD's teacher), and .eval_suites / .eval_jobs
for `post_eval`: the training manager queues post-training eval jobs through
the eval job manager and listens for their end to resolve the gate (semantics.md §8.14).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import no_request_body, request_body
from kiln.api.state import get_state
from kiln.train.distill_plan import plan_opd, plan_self_distill
from kiln.train.errors import CODE, PREFIX
from kiln.train.manager import TrainingManager
from kiln.train.plan import plan_dpo, plan_grpo, plan_sft
from kiln.train.requests import DpoRequest, GrpoRequest, OpdRequest, SelfDistillRequest, SftRequest
from kiln.train.submission import resume_training, submit_training

router = APIRouter(tags=["training"])

MAX_BODY_BYTES = 64 * 1024 * 1024


def _manager(request: Request) -> TrainingManager:
    return get_state(request).services.training


async def _body(request: Request) -> Any:
    return await read_json_body(request, code=CODE, prefix=PREFIX, max_bytes=MAX_BODY_BYTES,
                                hint="Upload the rows as a dataset and train from it by name.")


async def _submit(request: Request, model: type[BaseModel], planner) -> JSONResponse:
    state = get_state(request)
    manager = _manager(request)
    body = await _body(request)
    req = parse_model(model, body, code=CODE, prefix=PREFIX)
    engine = state.require_engine()
    return JSONResponse(await submit_training(manager, req, planner, engine, state.services.adapter_store,
                                              state.services.datasets, state.services.eval_suites,
                                              request_body=body if isinstance(body, dict) else None))


@router.post("/v1/train/sft")
@request_body(SftRequest)
async def train_sft(request: Request) -> JSONResponse:
    return await _submit(request, SftRequest, plan_sft)


@router.post("/v1/train/grpo")
@router.post("/v1/training/grpo", include_in_schema=False)
@request_body(GrpoRequest)
async def train_grpo(request: Request) -> JSONResponse:
    return await _submit(request, GrpoRequest, plan_grpo)


@router.post("/v1/train/dpo")
@request_body(DpoRequest)
async def train_dpo(request: Request) -> JSONResponse:
    return await _submit(request, DpoRequest, partial(plan_dpo, judgments=get_state(request).services.judgments))


@router.post("/v1/train/opd")
@request_body(OpdRequest)
async def train_opd(request: Request) -> JSONResponse:
    return await _submit(request, OpdRequest, partial(plan_opd, teachers=get_state(request).services.teachers))


@router.post("/v1/distill/self")
@request_body(SelfDistillRequest)
async def distill_self(request: Request) -> JSONResponse:
    return await _submit(request, SelfDistillRequest, plan_self_distill)


@router.post("/v1/train/jobs/{job_id}/resume")
@no_request_body
async def resume(request: Request, job_id: str) -> JSONResponse:
    state = get_state(request)
    return JSONResponse(await resume_training(_manager(request), job_id, state.require_engine(),
                                              state.services.adapter_store, state.services.datasets,
                                              state.services.eval_suites, state.services.judgments,
                                              state.services.teachers))


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
