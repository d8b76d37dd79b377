"""Suite synthesis from a dataset partition (semantics.md §1.6, §10): preview, and synthesize + save.

Needs `state.services.datasets` (DatasetStore) and `state.services.eval_suites` (SuiteStore),
built by those routers' `init`. `run_against` admits one on-demand run of the saved suite per adapter
through the eval job manager (`EvalJobManager`) found at request time under
`state.services.eval_jobs`; without one it is a 503 before anything is saved.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import read_json_body
from kiln.api.state import get_state
from kiln.data.datasets import DatasetStore, check_dataset_name
from kiln.data.formats import invalid
from kiln.errors import KilnError
from kiln.evals.admission import admit_run
from kiln.evals.requests import RunRequest
from kiln.evals.suite import aggregation_to_json, suite_summary
from kiln.evals.suite_store import SuiteStore
from kiln.evals.synthesis import (
    PreviewBody,
    SynthesisConfig,
    SynthesisResult,
    SynthesizeBody,
    parse_preview_body,
    parse_synthesize_body,
    synthesize,
)
from kiln.evals.synthesis.config import CODE, PREFIX

router = APIRouter(tags=["evals"])

MAX_BODY_BYTES = 32 * 1024 * 1024
PREVIEW_EXAMPLES = 10
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


def _run(store: DatasetStore, name: str, split: str, config: SynthesisConfig,
         max_conversations: int | None = None) -> SynthesisResult:
    check_dataset_name(name)
    if store.partition_count(name, split) == 0:  # 404 first when the dataset does not exist
        raise invalid(f"dataset {name!r} has no rows in its {split} partition", param="source_split",
                      hint="Pick another source_split, or change the split with PUT /v1/eval/datasets/{name}/split.")
    with contextlib.closing(store.iter_rows(name, split)) as rows:
        return synthesize(rows, config, dataset=name, source_split=split, max_conversations=max_conversations)


@router.post("/v1/eval/datasets/{name}/preview")
async def preview(request: Request, name: str) -> JSONResponse:
    body: PreviewBody = parse_preview_body(await _json_body(request))
    store = _datasets(request)
    result = await run_in_threadpool(_run, store, name, body.source_split, body, max(body.head_n, 1))
    suite = result.suite
    return JSONResponse({
        "examples": result.suite_json()["examples"][:PREVIEW_EXAMPLES],
        "stats": result.stats.to_json(),
        "suite_name": suite.name,
        "default_scorer_kind": suite.default_scorer.kind,
        "aggregation": aggregation_to_json(suite.aggregation),
        "completions_per_example": suite.k,
        "source_split": body.source_split,
    })


def _eval_jobs(request: Request) -> Any:
    jobs = get_state(request).services.eval_jobs
    if jobs is None or not all(hasattr(jobs, attr) for attr in ("ctx", "submit", "ensure_started")):
        raise KilnError(503, "eval_registry_unavailable", "run_against needs the eval job manager, which is not "
                        "available on this server", param="run_against",
                        hint="Synthesize without run_against, then start runs with POST /v1/eval/run.")
    return jobs


@router.post("/v1/eval/datasets/{name}/synthesize")
async def synthesize_suite(request: Request, name: str) -> JSONResponse:
    body: SynthesizeBody = parse_synthesize_body(await _json_body(request))
    datasets, suites = _datasets(request), _suites(request)
    adapters = list(body.run_against or [])
    jobs = None
    if adapters:
        # Checked before any work, so a missing job manager or an unknown adapter never leaves a
        # saved suite behind that the caller did not get runs for.
        jobs = _eval_jobs(request)
        for adapter in adapters:
            jobs.ctx.resolve_target(adapter or None)
    result = await run_in_threadpool(_run, datasets, name, body.source_split, body)
    await run_in_threadpool(suites.save, result.suite, force=body.force)
    queued = [_submit(jobs, result.suite.name, adapter) for adapter in adapters]
    return JSONResponse({
        "suite": suite_summary(result.suite),
        "stats": result.stats.to_json(),
        "queued_eval_job_ids": queued,
    })


def _submit(jobs: Any, suite_name: str, adapter: str) -> str:
    """Queue one on-demand run of the registered suite against `adapter` ("" = base), no generation override."""
    job = admit_run(jobs.ctx, RunRequest(suite_name=suite_name, adapter=adapter))
    jobs.ensure_started()
    return jobs.submit(job).job_id
