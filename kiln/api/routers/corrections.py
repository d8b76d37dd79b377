"""Corrections routes: record what a served answer should have been, list, delete, export, train.

  POST   /v1/corrections           {request_id | messages, corrected, note?, prompt_index?} -> the correction
  GET    /v1/corrections           ?state=pending|trained -> {object: list, data, counts}
  GET    /v1/corrections/{id}      one correction
  DELETE /v1/corrections/{id}      remove it
  POST   /v1/corrections/train     {config?, post_eval?} -> the training response (+ `corrections`)
  GET    /v1/corrections/export    ?state= -> the sft_chat rows as JSONL
  POST   /v1/corrections/export    {dataset, state?, description?} -> the new dataset's manifest

Services (built by `init`): state.services["corrections"], a CorrectionStore under
<data_dir>/corrections. Also used: ["recorder"] (the stats routes: finds a request by id),
["training"] (the train routes: runs the job, and tells the store when it ends), ["adapter_store"],
["adapters_active"], ["datasets"], ["eval_suites"].
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.state import ServerState, get_state
from kiln.engine.records import last_user_text, rehearsal_rows
from kiln.errors import KilnError
from kiln.train.corrections import (
    CODE,
    CORRECTIONS_SFT_DEFAULTS,
    DEFAULT_REPLAY,
    MAX_BATCH,
    STATES,
    Correction,
    CorrectionStore,
    invalid,
    job_outcome,
)
from kiln.train.errors import CODE as TRAIN_CODE
from kiln.train.errors import PREFIX as TRAIN_PREFIX
from kiln.train.plan import plan_sft
from kiln.train.requests import SftRequest

router = APIRouter(tags=["corrections"])
SERVICE = "corrections"
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
    # recent served answers nobody corrected, trained alongside as rehearsal (kiln.engine.records)
    replay: int = Field(DEFAULT_REPLAY, ge=0, le=64)


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str
    state: str | None = None
    description: str | None = None


def init(state: ServerState) -> None:
    if SERVICE in state.services:
        return
    store = CorrectionStore(Path(state.settings.data.data_dir) / "corrections")
    state.services[SERVICE] = store
    manager = state.services.get("training")
    if manager is None:
        return

    def on_job(job: Any) -> None:
        if job.job_id not in store.in_flight():
            return
        decided, trained, outcome = job_outcome(job)
        if decided:
            store.resolve(job.job_id, trained=trained, adapter=job.adapter_name, outcome=outcome)

    manager.listeners.append(on_job)
    # A restart forgets running jobs: settle what the archive says; a job that never ended is gone.
    for job_id in list(store.in_flight()):
        try:
            job = manager.get(job_id)
        except KilnError:
            store.resolve(job_id, trained=False, outcome="job not found after restart")
            continue
        decided, trained, outcome = job_outcome(job)
        if decided:
            store.resolve(job_id, trained=trained, adapter=job.adapter_name, outcome=outcome)
        elif job.state != "completed":
            store.resolve(job_id, trained=False, outcome="interrupted by a restart")


def _store(request: Request) -> CorrectionStore:
    return get_state(request).services[SERVICE]


def _view(c: Correction) -> dict[str, Any]:
    return {"object": "kiln.correction", **c.to_dict()}


@router.post("/v1/corrections")
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
    else:
        if req.prompt_index is not None:
            raise invalid("`prompt_index` names a prompt of a batch request; it needs `request_id`",
                          param="prompt_index")
        messages = req.messages
    c = await run_in_threadpool(_store(request).add, messages, req.corrected, request_id=req.request_id,
                                original=original, adapter=adapter, note=req.note)
    return JSONResponse(_view(c))


def _served(state: ServerState, request_id: str, prompt_index: int | None) -> tuple[list, dict | None, str]:
    recorder = state.services.get("recorder")
    rec = recorder.find(request_id) if recorder is not None else None
    logging_on = state.settings.request_log.enabled
    if rec is None:
        where = "the recent-request ring" + (" or the request log" if logging_on else "")
        raise KilnError(404, "request_not_found", f"no served request {request_id!r} in {where}", param="request_id",
                        hint="Use the `id` of a chat completion (chatcmpl-...) as GET /v1/stats/recent-requests "
                             "shows it, or send `messages` instead."
                             + ("" if logging_on else " Enable [request_log] to find older requests."))
    if not rec.correctable:
        raise KilnError(409, "request_not_captured", f"request {request_id!r} was too large to keep its messages",
                        param="request_id", hint="Send the conversation as `messages` instead.")
    if rec.kind == "batch":
        count = len(rec.prompts or [])
        if prompt_index is None and count > 1:
            raise invalid(f"request {request_id!r} is a batch of {count} prompts; say which with `prompt_index`",
                          param="prompt_index")
        index = prompt_index or 0
        if index >= count:
            raise invalid(f"`prompt_index` {index} is out of range for a batch of {count} prompts",
                          param="prompt_index")
    elif prompt_index not in (None, 0):
        raise invalid("`prompt_index` applies to batch requests only", param="prompt_index")
    else:
        index = 0
    answer = rec.answer(index)
    messages = rec.conversation(index)
    assert messages is not None
    return list(messages), answer.message() if answer is not None else None, rec.adapter


@router.get("/v1/corrections")
async def list_corrections(request: Request) -> JSONResponse:
    store = _store(request)
    state = _state_param(request.query_params.get("state"))
    return JSONResponse({"object": "list", "data": [_view(c) for c in store.list(state)], "counts": store.counts()})


def _state_param(value: str | None) -> str | None:
    if value is None or value == "all":
        return None
    if value not in STATES:
        raise invalid(f"state must be one of {', '.join(STATES)} or all, got {value!r}", param="state",
                      hint="GET /v1/corrections?state=pending")
    return value


@router.get("/v1/corrections/export")
async def export_corrections(request: Request) -> Response:
    rows = [c.sft_row() for c in _store(request).list(_state_param(request.query_params.get("state")))]
    rows.reverse()  # oldest first, the order they were made
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return Response(body, media_type="application/jsonl",
                    headers={"content-disposition": 'attachment; filename="corrections.jsonl"'})


@router.post("/v1/corrections/export")
async def export_to_dataset(request: Request) -> JSONResponse:
    state = get_state(request)
    req = parse_model(ExportRequest, await read_json_body(request, code=CODE, prefix=PREFIX), code=CODE,
                      prefix=PREFIX)
    datasets = state.services.get("datasets")
    if datasets is None:
        raise KilnError(503, "dataset_registry_unavailable", "the dataset registry is not available",
                        hint="Use GET /v1/corrections/export for the rows as JSONL.")
    chosen = list(reversed(_store(request).list(_state_param(req.state))))
    if not chosen:
        raise invalid("there are no corrections to export" + (f" in state {req.state!r}" if req.state else ""),
                      param="state")
    manifest = await run_in_threadpool(datasets.create_rows, req.dataset, [c.sft_row() for c in chosen],
                                       description=req.description or f"{len(chosen)} corrections")
    return JSONResponse(manifest)


@router.get("/v1/corrections/{correction_id}")
async def get_correction(request: Request, correction_id: str) -> JSONResponse:
    return JSONResponse(_view(_store(request).get(correction_id)))


@router.delete("/v1/corrections/{correction_id}")
async def delete_correction(request: Request, correction_id: str) -> JSONResponse:
    c = await run_in_threadpool(_store(request).delete, correction_id)
    return JSONResponse({"id": c.id, "object": "kiln.correction", "deleted": True})


def corrections_config(config: dict[str, Any], active_name: str | None, num_rows: int) -> dict[str, Any]:
    """The SFT config a corrections job runs with: the caller's fields, then the corrections recipe
    (all rows in one batch, up to MAX_BATCH, so an epoch is one step).

    Without `base_adapter` the job continues the active adapter (what served the corrected answers),
    so what it learned before stays; `"base_adapter": null` starts from the base model.
    """
    out = dict(config)
    out.setdefault("batch_size", max(1, min(num_rows, MAX_BATCH)))
    if "base_adapter" not in out and active_name:
        out["base_adapter"] = active_name
    continuing = out.get("base_adapter") is not None
    for key, value in CORRECTIONS_SFT_DEFAULTS.items():
        if continuing and key in ("lora_rank", "lora_alpha"):
            continue  # a continued adapter keeps its shape
        out.setdefault(key, value)
    if out.get("output_name") is None:
        out["output_name"] = "corrections-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return out


@router.post("/v1/corrections/train")
async def train_corrections(request: Request) -> JSONResponse:
    state = get_state(request)
    store = _store(request)
    manager = state.services.get("training")
    if manager is None:
        raise KilnError(503, "training_unavailable", "this server runs no training jobs")
    body = parse_model(TrainCorrectionsRequest, await read_json_body(request, code=TRAIN_CODE, prefix=TRAIN_PREFIX),
                       code=TRAIN_CODE, prefix=TRAIN_PREFIX)
    chosen = store.trainable()
    if not chosen:
        in_flight = store.in_flight()
        raise KilnError(409 if in_flight else 400, "no_pending_corrections",
                        "no pending corrections to train" + (
                            f" (job {', '.join(in_flight)} is training the others)" if in_flight else ""),
                        hint="POST /v1/corrections adds one; GET /v1/corrections lists them.")
    engine = state.engine
    if engine is None:
        raise KilnError(503, "model_loading", "the model is still loading", hint="Retry when GET /health answers 200.",
                        headers={"Retry-After": "5"})
    active = getattr(state.services.get("adapters_active"), "name", None)
    recorder = state.services.get("recorder")
    replay = rehearsal_rows(recorder.ring.list(), body.replay, exclude_ids=[c.request_id for c in chosen if c.request_id],
                            exclude_prompts=[last_user_text(c.messages) for c in chosen]) if recorder else []
    rows = [c.sft_row() for c in chosen] + replay
    sft: dict[str, Any] = {"examples": rows, "config": corrections_config(body.config, active, len(rows))}
    if body.post_eval is not None:
        sft["post_eval"] = body.post_eval
    req = parse_model(SftRequest, sft, code=TRAIN_CODE, prefix=TRAIN_PREFIX)
    manager.check_capacity()
    plan = await run_in_threadpool(plan_sft, req, engine, state.services["adapter_store"],
                                   state.services.get("datasets"), state.services.get("eval_suites"))
    ids = [c.id for c in chosen]
    plan.data.source = "corrections"
    plan.stats["correction_ids"] = ids
    plan.stats["replayed_rows"] = len(replay)
    if plan.post_eval is not None and manager.eval_link is not None:
        manager.eval_link.bind_loop(asyncio.get_running_loop())
    # Taken before the job exists: a tiny job can finish before submit() returns.
    await run_in_threadpool(store.submitted, ids, plan.job_id)
    try:
        job = manager.submit(plan)
    except BaseException:
        store.resolve(plan.job_id, trained=False, outcome="not queued")
        raise
    return JSONResponse({"job_id": job.job_id, "state": "queued", "adapter_name": job.adapter_name,
                         "message": f"Queued SFT job training adapter `{job.adapter_name}` on {len(ids)} "
                                    f"correction{'s' if len(ids) != 1 else ''} and {len(replay)} rehearsed "
                                    f"answer{'s' if len(replay) != 1 else ''} ({job.total_steps} steps)",
                         "corrections": ids, "replayed": len(replay)})
