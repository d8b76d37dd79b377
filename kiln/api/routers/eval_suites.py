"""Eval suite registry routes (semantics.md §1.5): register, list, fetch, delete."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import read_json_body
from kiln.api.state import get_state
from kiln.evals.suite import CODE, PREFIX, parse_suite
from kiln.evals.suite_store import SuiteStore

router = APIRouter(tags=["evals"])

MAX_BODY_BYTES = 32 * 1024 * 1024



def _store(request: Request) -> SuiteStore:
    return get_state(request).services.eval_suites





@router.get("/v1/eval/suites")
async def list_suites(request: Request) -> JSONResponse:
    return JSONResponse({"suites": _store(request).list_summaries()})


@router.post("/v1/eval/suites")
async def save_suite(request: Request, force: bool = False) -> JSONResponse:
    suite = parse_suite(await read_json_body(request, code=CODE, prefix=PREFIX, max_bytes=MAX_BODY_BYTES,
                                             what="suite body",
                                             hint="Split the suite, or register it from a file with the CLI."))
    path, status = _store(request).save(suite, force=force)
    return JSONResponse({"name": suite.name, "path": str(path.resolve()), "status": status})


@router.get("/v1/eval/suites/{name}")
async def get_suite(request: Request, name: str) -> JSONResponse:
    return JSONResponse(_store(request).get_json(name))


@router.delete("/v1/eval/suites/{name}")
async def delete_suite(request: Request, name: str) -> JSONResponse:
    _store(request).delete(name)
    return JSONResponse({"status": "deleted", "name": name})
