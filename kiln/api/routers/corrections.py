"""Corrections routes: record what a served answer should have been, list, delete, export, train.

  POST   /v1/corrections           {request_id | messages, corrected, note?, prompt_index?} -> the correction
  GET    /v1/corrections           ?state=pending|trained -> {object: list, data, counts}
  GET    /v1/corrections/{id}      one correction
  DELETE /v1/corrections/{id}      remove it
  POST   /v1/corrections/train     {config?, post_eval?, replay?} -> the training receipt (+ `corrections`, `replayed`)
  GET    /v1/corrections/export    ?state= -> the sft_chat rows as JSONL
  POST   /v1/corrections/export    {dataset, state?, description?} -> the new dataset's manifest

Services (built by kiln.server.build_server): state.services.corrections, a CorrectionStore under
<data_dir>/corrections (kiln.train.corrections). Also used: .recorder (finds a served request by id),
.training (runs the job and tells the store when it ends), .adapter_store, .adapters_active,
.datasets, .eval_suites.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import request_body
from kiln.api.state import ServerState, get_state
from kiln.errors import KilnError
from kiln.traffic.conversations import served_conversation
from kiln.traffic.records import last_user_text, rehearsal_rows
from kiln.train.corrections import (
    CODE,
    DEFAULT_REPLAY,
    STATES,
    Correction,
    CorrectionStore,
    invalid,
    submit_corrections,
)
from kiln.train.errors import CODE as TRAIN_CODE
from kiln.train.errors import PREFIX as TRAIN_PREFIX
from kiln.train.requests import SftRequest

router = APIRouter(tags=["corrections"])
PREFIX = "Invalid correction: "


class CorrectionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = None
    messages: list[Any] | None = None
    corrected: Any
    note: str | None = Field(None, max_length=4000)
    prompt_index: int | None = Field(None, ge=0)   # which prompt of a batch request


class TrainCorrectionsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(default_factory=dict)
    post_eval: dict[str, Any] | None = None
    # recent served answers nobody corrected, trained alongside as rehearsal (kiln.traffic.records)
    replay: int = Field(DEFAULT_REPLAY, ge=0, le=64)


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str
    state: str | None = None
    description: str | None = None



def _store(request: Request) -> CorrectionStore:
    return get_state(request).services.corrections


def _view(c: Correction) -> dict[str, Any]:
    return {"object": "kiln.correction", **c.to_dict()}


def _state_param(value: str | None) -> str | None:
    if value is None or value == "all":
        return None
    if value not in STATES:
        raise invalid(f"state must be one of {', '.join(STATES)} or all, got {value!r}", param="state",
                      hint="GET /v1/corrections?state=pending")
    return value


def _served(state: ServerState, request_id: str, prompt_index: int | None) -> tuple[list, dict | None, str]:
    return served_conversation(state.services.recorder, request_id, prompt_index, invalid=invalid)


@router.post("/v1/corrections")
@request_body(CorrectionRequest)
async def add_correction(request: Request) -> JSONResponse:
    state = get_state(request)
    req = parse_model(CorrectionRequest, await read_json_body(request, code=CODE, prefix=PREFIX),
                      code=CODE, prefix=PREFIX)
    if (req.request_id is None) == (req.messages is None):
        raise invalid("give exactly one of `request_id` (a served completion's id) and `messages`",
                      param="request_id" if req.request_id is not None else "messages")
    original = adapter = None
    if req.request_id is not None:
        # off the loop: a request that left the ring is looked up in the request log's files
        messages, original, adapter = await run_in_threadpool(_served, state, req.request_id, req.prompt_index)
    elif req.prompt_index is not None:
        raise invalid("`prompt_index` names a prompt of a batch request; it needs `request_id`", param="prompt_index")
    else:
        messages = req.messages
    c = await run_in_threadpool(_store(request).add, messages, req.corrected, request_id=req.request_id,
                                original=original, adapter=adapter, note=req.note)
    return JSONResponse(_view(c))


@router.get("/v1/corrections")
async def list_corrections(request: Request) -> JSONResponse:
    store = _store(request)
    state = _state_param(request.query_params.get("state"))
    return JSONResponse({"object": "list", "data": [_view(c) for c in store.list(state)], "counts": store.counts()})


@router.get("/v1/corrections/export")
async def export_corrections(request: Request) -> Response:
    rows = [c.sft_row() for c in reversed(_store(request).list(_state_param(request.query_params.get("state"))))]
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)   # oldest first
    return Response(body, media_type="application/jsonl",
                    headers={"content-disposition": 'attachment; filename="corrections.jsonl"'})


@router.post("/v1/corrections/export")
@request_body(ExportRequest)
async def export_to_dataset(request: Request) -> JSONResponse:
    state = get_state(request)
    req = parse_model(ExportRequest, await read_json_body(request, code=CODE, prefix=PREFIX), code=CODE,
                      prefix=PREFIX)
    chosen = list(reversed(_store(request).list(_state_param(req.state))))
    if not chosen:
        raise invalid("there are no corrections to export" + (f" in state {req.state!r}" if req.state else ""),
                      param="state")
    manifest = await run_in_threadpool(state.services.datasets.create_rows, req.dataset, [c.sft_row() for c in chosen],
                                       description=req.description or f"{len(chosen)} corrections")
    return JSONResponse(manifest)


@router.get("/v1/corrections/{correction_id}")
async def get_correction(request: Request, correction_id: str) -> JSONResponse:
    return JSONResponse(_view(_store(request).get(correction_id)))


@router.delete("/v1/corrections/{correction_id}")
async def delete_correction(request: Request, correction_id: str) -> JSONResponse:
    c = await run_in_threadpool(_store(request).delete, correction_id)
    return JSONResponse({"id": c.id, "object": "kiln.correction", "deleted": True})


@router.post("/v1/corrections/train")
@request_body(TrainCorrectionsRequest)
async def train_corrections(request: Request) -> JSONResponse:
    state = get_state(request)
    body = parse_model(TrainCorrectionsRequest, await read_json_body(request, code=TRAIN_CODE, prefix=TRAIN_PREFIX),
                       code=TRAIN_CODE, prefix=TRAIN_PREFIX)
    recorder = state.services.recorder

    def rehearsal(chosen: list[Correction]) -> list[dict[str, Any]]:
        if recorder is None:
            return []
        return rehearsal_rows(recorder.ring.list(), body.replay,
                              exclude_ids=[c.request_id for c in chosen if c.request_id],
                              exclude_prompts=[last_user_text(c.messages) for c in chosen])

    engine = state.require_engine()
    try:
        manager = state.services.training
    except Exception:  # noqa: BLE001
        raise KilnError(503, "training_unavailable", "this server runs no training jobs") from None
    return JSONResponse(await submit_corrections(
        _store(request), manager, config=body.config, post_eval=body.post_eval, rehearsal=rehearsal,
        parse=lambda sft: parse_model(SftRequest, sft, code=TRAIN_CODE, prefix=TRAIN_PREFIX),
        active_name=state.services.active_adapter_name(), engine=engine, adapters=state.services.adapter_store,
        datasets=state.services.datasets, suites=state.services.eval_suites))
