"""Teacher routes: list, register (verified), delete. The registry and its checks are kiln/train/teachers.py.

Needs `state.services.teachers` (a TeacherStore under `<data_dir>/teachers`; `init` builds it), the engine
(its tokenizer is what a teacher must share) and the adapter store (a local teacher's adapter).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.services import ensure_adapters, ensure_teachers
from kiln.api.state import ServerState, get_state
from kiln.train.teachers import CODE, TeacherRequest, register

router = APIRouter(tags=["training"])


def init(state: ServerState) -> None:
    ensure_teachers(state)


@router.get("/v1/teachers")
def list_teachers(request: Request) -> dict[str, Any]:
    return {"teachers": ensure_teachers(get_state(request)).list()}


@router.post("/v1/teachers")
async def register_teacher(request: Request) -> dict[str, Any]:
    state = get_state(request)
    body = parse_model(TeacherRequest, await read_json_body(request, code=CODE, prefix="Invalid teacher: "),
                       code=CODE, prefix="Invalid teacher: ")
    return await run_in_threadpool(register, body, state.require_engine(), ensure_adapters(state),
                                   ensure_teachers(state))


@router.delete("/v1/teachers/{alias}")
def delete_teacher(request: Request, alias: str) -> dict[str, Any]:
    ensure_teachers(get_state(request)).delete(alias)
    return {"status": "deleted", "alias": alias}
