"""Eval job routes (semantics.md §1.5, §8.10-8.13): run, compare, list, result, cancel, rerun, replay.

Services (built by `init` unless a test put its own first):
  state.services["eval_jobs"]    EvalJobManager (archives under <data_dir>/eval/jobs)
  state.services["eval_suites"]  SuiteStore, shared with the suite routes
Adapters are known through state.services["adapter_store"] when present; the default for a run
without an adapter comes from state.services["adapters_active"].
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import read_json_body
from kiln.api.state import ServerState, get_state
from kiln.engine.eval_generator import LocalEngineGenerator
from kiln.errors import KilnError
from kiln.evals.admission import (
    AdmissionContext,
    admit_compare,
    admit_replay,
    admit_rerun,
    admit_run,
    base_target_only,
)
from kiln.evals.generator import Generator
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.job_store import EvalJobStore, job_root
from kiln.evals.jobs import EvalJob
from kiln.evals.requests import parse_compare_spec, parse_replay_body, parse_rerun_body, parse_run_request
from kiln.evals.suite import CODE, PREFIX
from kiln.evals.suite_store import SuiteStore, suite_root

router = APIRouter(tags=["evals"])

SERVICE = "eval_jobs"
MAX_BODY_BYTES = 32 * 1024 * 1024


def _resolver(state: ServerState):
    def resolve(adapter: str | None) -> dict[str, Any]:
        store = state.services.get("adapter_store")
        if adapter is None or store is None:
            return base_target_only(adapter)
        store.require(adapter, param="adapter")  # 400 for a bad name, 404 for an unknown one
        return {"adapter": adapter, "adapter_content_sha256": store.content_hash(adapter)}

    return resolve


def _active_adapter(state: ServerState):
    def active() -> str | None:
        holder = state.services.get("adapters_active")
        return getattr(holder, "name", None) or None

    return active


def _generator_factory(state: ServerState):
    cache: dict[int, Generator] = {}

    def generator() -> Generator:
        engine = state.engine
        if engine is None:
            raise KilnError(503, "model_loading", "the model is still loading",
                            hint="Retry when GET /health answers 200.", headers={"Retry-After": "5"})
        if id(engine) not in cache:
            cache.clear()
            cache[id(engine)] = LocalEngineGenerator(engine, state.settings.server)
        return cache[id(engine)]

    return generator


def init(state: ServerState) -> None:
    if SERVICE in state.services:
        return
    suites = state.services.setdefault("eval_suites", SuiteStore(suite_root(state.settings.data.data_dir)))
    ctx = AdmissionContext(suites=suites, resolve_target=_resolver(state), active_adapter=_active_adapter(state))
    manager = EvalJobManager(EvalJobStore(job_root(state.settings.data.data_dir)), ctx, _generator_factory(state),
                             max_queued_jobs=state.settings.eval.max_queued_jobs,
                             max_tracked_jobs=state.settings.eval.max_tracked_jobs)
    manager.load_archived()
    state.services[SERVICE] = manager


def _manager(request: Request) -> EvalJobManager:
    manager: EvalJobManager = get_state(request).services[SERVICE]
    manager.ensure_started()
    return manager


async def _body(request: Request, *, optional: bool = False) -> Any:
    declared = request.headers.get("content-length")
    raw = await request.body()
    if (declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES) or len(raw) > MAX_BODY_BYTES:
        raise KilnError(413, CODE, f"{PREFIX}request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                        hint="Register the suite first and run it by name.")
    if optional and not raw.strip():
        return None
    return await read_json_body(request, code=CODE, prefix=PREFIX)


def _receipt(job: EvalJob, message: str) -> JSONResponse:
    return JSONResponse({"job_id": job.job_id, "state": "queued", "effective_seed": str(job.effective_seed),
                         "message": message})


@router.post("/v1/eval/run")
async def run_eval(request: Request) -> JSONResponse:
    manager = _manager(request)
    req = parse_run_request(await _body(request))
    manager.generator()  # 503 while the model loads
    job = manager.submit(admit_run(manager.ctx, req))
    return _receipt(job, f"Queued eval against suite `{job.suite.name}`")


@router.post("/v1/eval/compare")
async def compare_eval(request: Request) -> JSONResponse:
    manager = _manager(request)
    spec = parse_compare_spec(await _body(request))
    manager.generator()
    job = manager.submit(admit_compare(manager.ctx, spec))
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
    job = manager.submit(admit_rerun(manager.ctx, source, spec))
    return _receipt(job, f"Queued re-run of {len(job.suite.examples)} example(s) from `{source.suite.name}`")


@router.post("/v1/eval/jobs/{job_id}/replay")
async def replay_job(request: Request, job_id: str) -> JSONResponse:
    manager = _manager(request)
    source = manager.get(job_id)
    run_index = parse_replay_body(await _body(request, optional=True))
    current = await manager.generator().identity()
    job = manager.submit(admit_replay(manager.ctx, source, run_index, current))
    return _receipt(job, f"Queued strict replay of source job `{job_id}` run {run_index}")
