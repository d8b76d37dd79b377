"""Eval job routes (semantics.md §1.5, §8.10-8.13): run, compare, list, result, cancel, rerun, replay.

Services (built by kiln.server.build_server):
  state.services.eval_jobs    EvalJobManager (archives under <data_dir>/eval/jobs)
  state.services.eval_suites  SuiteStore, shared with the suite routes
Adapters are known through state.services.adapter_store when present; the default for a run
without an adapter comes from state.services.adapters_active.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import read_json_body
from kiln.api.state import get_state
from kiln.evals.intake import (
    job_for_compare,
    job_for_replay,
    job_for_rerun,
    job_for_run,
)
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.jobs import EvalJob
from kiln.evals.requests import parse_compare_spec, parse_replay_body, parse_rerun_body, parse_run_request
from kiln.evals.suite import CODE, PREFIX

router = APIRouter(tags=["evals"])

MAX_BODY_BYTES = 32 * 1024 * 1024



def _manager(request: Request) -> EvalJobManager:
    manager = get_state(request).services.eval_jobs
    manager.start_worker()
    return manager


async def _body(request: Request, *, optional: bool = False) -> Any:
    return await read_json_body(request, code=CODE, prefix=PREFIX, max_bytes=MAX_BODY_BYTES, optional=optional,
                                hint="Register the suite first and run it by name.")


def _receipt(job: EvalJob, message: str) -> JSONResponse:
    return JSONResponse({"job_id": job.job_id, "state": "queued", "effective_seed": str(job.effective_seed),
                         "message": message})


@router.post("/v1/eval/run")
async def run_eval(request: Request) -> JSONResponse:
    manager = _manager(request)
    body = await _body(request)
    req = parse_run_request(body)
    manager.generator()  # 503 while the model loads
    job = job_for_run(manager.ctx, req)
    if body.get("replicas") is not None:  # "all" or names: fan out over them too (kiln.evals.fanout)
        await run_in_threadpool(manager.admit_replicas, job, body["replicas"])
    job = manager.submit(job)
    return _receipt(job, f"Queued eval against suite `{job.suite.name}`")


@router.get("/v1/eval/jobs/{job_id}/placement")
async def job_placement(request: Request, job_id: str) -> JSONResponse:
    """Which target (the local engine or a replica) answered each example, and what failed before."""
    manager = _manager(request)
    job = manager.get(job_id)
    placement = manager.fanout.placement(job.job_id) if manager.fanout is not None else None
    if placement is None:
        placement = {"job_id": job.job_id, "replicas": None, "examples": []}
    return JSONResponse(placement)


@router.post("/v1/eval/compare")
async def compare_eval(request: Request) -> JSONResponse:
    manager = _manager(request)
    spec = parse_compare_spec(await _body(request))
    manager.generator()
    job = manager.submit(job_for_compare(manager.ctx, spec))
    return _receipt(job, f"Queued compare-mode eval against suite `{job.suite.name}`")


@router.get("/v1/eval/jobs")
async def list_jobs(request: Request) -> JSONResponse:
    return JSONResponse({"jobs": [job.info() for job in _manager(request).all_jobs()]})


@router.get("/v1/eval/jobs/{job_id}")
async def get_job(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(_manager(request).get(job_id).result())


@router.delete("/v1/eval/jobs/{job_id}")
async def cancel_job(request: Request, job_id: str) -> JSONResponse:
    return JSONResponse(_manager(request).cancel(job_id))


@router.post("/v1/eval/jobs/{job_id}/rerun")
async def rerun_job(request: Request, job_id: str) -> JSONResponse:
    manager = _manager(request)
    source = manager.get(job_id)
    spec = parse_rerun_body(await _body(request, optional=True))
    manager.generator()
    job = manager.submit(job_for_rerun(manager.ctx, source, spec))
    return _receipt(job, f"Queued re-run of {len(job.suite.examples)} example(s) from `{source.suite.name}`")


@router.post("/v1/eval/jobs/{job_id}/replay")
async def replay_job(request: Request, job_id: str) -> JSONResponse:
    manager = _manager(request)
    source = manager.get(job_id)
    run_index = parse_replay_body(await _body(request, optional=True))
    current = await manager.generator().identity()
    job = manager.submit(job_for_replay(manager.ctx, source, run_index, current))
    return _receipt(job, f"Queued strict replay of source job `{job_id}` run {run_index}")
