"""Judgment routes: create, list, append, delete, render the judge prompt, compile, validate, export as
preference JSONL (§1.7, §11).

Needs `state.services.judgments` (a JudgmentStore under `<data_dir>/judgments`) and
`state.services.datasets` for compile (kiln.server.build_server builds both). Validate queues an eval
through `state.services.eval_jobs`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.state import get_state
from kiln.data.judge_prompt import render_judge_prompt
from kiln.data.judgment_rows import INVALID, row_from_body
from kiln.data.judgments import JudgmentStore
from kiln.errors import KilnError
from kiln.evals.judge_validation_job import queue_judge_validation
from kiln.store.clock import utc_now_rfc3339

router = APIRouter(tags=["evals"])
CODE = "judgment_invalid"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatMessageBody(_Body):
    role: str
    content: str | list[Any] | None = None
    tool_calls: list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class CreateJudgmentBody(_Body):
    name: str
    description: str | None = None


class AppendJudgmentBody(_Body):
    id: str | None = None
    prompt: list[ChatMessageBody]
    adapter_a: str | None = None
    adapter_b: str | None = None
    response_a: str
    response_b: str
    winner: Literal["a", "b", "tie", "skip"]
    note: str | None = None
    tags: list[str] = Field(default_factory=list)


class CompileJudgmentBody(_Body):
    output_dataset: str
    include_skips: bool = False
    holdout_n: int | None = Field(default=None, ge=0)


class PromoteJudgmentBody(_Body):
    adapter: str = Field(strict=True)  # "" = the base model
    holdout_n: int | None = Field(default=None, ge=0, strict=True)



def _store(request: Request) -> JudgmentStore:
    return get_state(request).services.judgments


async def _body(request: Request, model: type[_Body]) -> Any:
    data = await read_json_body(request, code=CODE, prefix=INVALID)
    return parse_model(model, data, code=CODE, prefix=INVALID)


@router.get("/v1/judgments")
def list_judgments(request: Request) -> dict[str, Any]:
    return {"judgments": _store(request).list()}


@router.post("/v1/judgments")
async def create_judgment(request: Request) -> dict[str, Any]:
    body: CreateJudgmentBody = await _body(request, CreateJudgmentBody)
    return await run_in_threadpool(_store(request).create, body.name, body.description)


@router.post("/v1/judgments/render_prompt")
async def render_prompt(request: Request) -> dict[str, Any]:
    body: AppendJudgmentBody = await _body(request, AppendJudgmentBody)
    row = row_from_body(body.model_dump(), utc_now_rfc3339())
    return {"prompt": render_judge_prompt(row.prompt, row.response_a, row.response_b)}


@router.get("/v1/judgments/{name}")
def get_judgment(request: Request, name: str) -> dict[str, Any]:
    return _store(request).get(name)


@router.get("/v1/judgments/{name}/export")
def export_judgment(request: Request, name: str, format: str = "trl") -> Response:
    """The set's A/B judgments as preference JSONL (`format` trl or openai); ties and skips are left out."""
    body, found = _store(request).export(name, format)
    return Response(body, media_type="application/jsonl", headers={
        "Content-Disposition": f'attachment; filename="{name.replace(chr(34), "_")}.{format}.jsonl"',
        "X-Kiln-Pairs": str(len(found.pairs)), "X-Kiln-Ties-Left-Out": str(found.ties),
        "X-Kiln-Skips-Left-Out": str(found.skips)})


@router.get("/v1/judgments/{name}/rows")
def list_rows(request: Request, name: str) -> dict[str, Any]:
    return {"name": name, "rows": _store(request).rows(name)}


@router.post("/v1/judgments/{name}/rows")
async def append_row(request: Request, name: str) -> dict[str, Any]:
    body: AppendJudgmentBody = await _body(request, AppendJudgmentBody)
    return await run_in_threadpool(_store(request).append, name, body.model_dump())


@router.delete("/v1/judgments/{name}/rows/{judgment_id}")
def delete_row(request: Request, name: str, judgment_id: str) -> dict[str, Any]:
    return _store(request).delete_row(name, judgment_id)


@router.delete("/v1/judgments/{name}")
def delete_judgment(request: Request, name: str) -> dict[str, Any]:
    _store(request).delete(name)
    return {"status": "deleted", "name": name}


@router.post("/v1/judgments/{name}/compile")
async def compile_judgment(request: Request, name: str) -> dict[str, Any]:
    body: CompileJudgmentBody = await _body(request, CompileJudgmentBody)
    state = get_state(request)
    return await run_in_threadpool(
        _store(request).compile, name, state.services.datasets, body.output_dataset,
        holdout_n=body.holdout_n, include_skips=body.include_skips,
    )


@router.post("/v1/judgments/{name}/validate")
async def validate_judgment(request: Request, name: str) -> JSONResponse:
    """Queue the held-out `judge-validate-<name>` suite against the judge adapter (semantics.md §11.4)."""
    body: PromoteJudgmentBody = await _body(request, PromoteJudgmentBody)
    jobs = get_state(request).services.eval_jobs
    if jobs is None:
        raise KilnError(503, "eval_registry_unavailable", "judge validation needs the eval job manager, which is "
                        "not available on this server", hint="Start the server with the eval routes enabled.")
    return JSONResponse(await queue_judge_validation(jobs, _store(request), name, body.adapter, body.holdout_n))
