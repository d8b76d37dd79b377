"""Suite synthesis from a dataset partition (semantics.md §1.6, §10): preview, and synthesize + save.

Needs `state.services.datasets` (DatasetStore) and `state.services.eval_suites` (SuiteStore),
built by kiln.server.build_server. `run_against` admits one on-demand run of the saved suite per adapter
through the eval job manager (`EvalJobManager`) at `state.services.eval_jobs`; a server without a
usable one answers 503 before anything is saved.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import read_json_body
from kiln.api.state import get_state
from kiln.data.datasets import DatasetStore
from kiln.errors import KilnError
from kiln.evals.suite_store import SuiteStore
from kiln.evals.synthesis import (
    PreviewBody,
    SynthesizeBody,
    parse_preview_body,
    parse_synthesize_body,
)
from kiln.evals.synthesis.config import CODE, PREFIX
from kiln.evals.synthesis.service import preview, synthesize_and_save

router = APIRouter(tags=["evals"])

MAX_BODY_BYTES = 32 * 1024 * 1024
DATASETS, SUITES = "datasets", "eval_suites"


async def _json_body(request: Request) -> Any:
    return await read_json_body(request, code=CODE, prefix=PREFIX, max_bytes=MAX_BODY_BYTES, what="synthesis body",
                                hint="Send the synthesis config only; the conversations come from the dataset.")


def _service(request: Request, key: str, code: str, what: str) -> Any:
    service = getattr(get_state(request).services, key)
    if service is None:
        raise KilnError(503, code, f"the {what} is not available on this server",
                        hint="Check that [data] data_dir exists and is writable, then restart the server.")
    return service


def _datasets(request: Request) -> DatasetStore:
    return _service(request, DATASETS, "dataset_registry_unavailable", "dataset store")


def _suites(request: Request) -> SuiteStore:
    return _service(request, SUITES, "eval_registry_unavailable", "eval suite registry")


@router.post("/v1/eval/datasets/{name}/preview")
async def preview_suite(request: Request, name: str) -> JSONResponse:
    body: PreviewBody = parse_preview_body(await _json_body(request))
    return JSONResponse(await preview(_datasets(request), name, body))


def _eval_jobs(request: Request) -> Any:
    jobs = get_state(request).services.eval_jobs
    if jobs is None or not all(hasattr(jobs, attr) for attr in ("ctx", "submit", "start_worker")):
        raise KilnError(503, "eval_registry_unavailable", "run_against needs the eval job manager, which is not "
                        "available on this server", param="run_against",
                        hint="Synthesize without run_against, then start runs with POST /v1/eval/run.")
    return jobs


@router.post("/v1/eval/datasets/{name}/synthesize")
async def synthesize_suite(request: Request, name: str) -> JSONResponse:
    body: SynthesizeBody = parse_synthesize_body(await _json_body(request))
    datasets, suites = _datasets(request), _suites(request)
    jobs = _eval_jobs(request) if body.run_against else None  # a 503 before any work
    return JSONResponse(await synthesize_and_save(datasets, suites, jobs, name, body))
