"""Teacher routes: list, register (verified), delete. The registry and its checks are kiln/train/teachers.py.

Needs `state.services.teachers` (a TeacherStore under `<data_dir>/teachers`, built by kiln.server), the engine
(its tokenizer is what a teacher must share) and the adapter store (a local teacher's adapter).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import request_body
from kiln.api.state import get_state
from kiln.train.teachers import CODE, TeacherRequest, register

router = APIRouter(tags=["training"])


@router.get("/v1/teachers")
def list_teachers(request: Request) -> dict[str, Any]:
    return {"teachers": get_state(request).services.teachers.list()}


@router.post("/v1/teachers")
@request_body(TeacherRequest)
async def register_teacher(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = parse_model(TeacherRequest, await read_json_body(request, code=CODE, prefix="Invalid teacher: "),
                       code=CODE, prefix="Invalid teacher: ")
    return await run_in_threadpool(register, body, state.require_engine(), state.services.adapter_store,
                                   state.services.teachers)


@router.delete("/v1/teachers/{alias}")
def delete_teacher(request: Request, alias: str) -> dict[str, Any]:
    get_state(request).services.teachers.delete(alias)
    return {"status": "deleted", "alias": alias}
