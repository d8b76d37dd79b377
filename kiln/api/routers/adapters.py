"""Adapter routes (semantics.md §1.3, §7): list, upload, download, detail, receipt, delete, merge, load/unload.

Services (built by kiln.server.build_server):
  state.services.adapter_store          AdapterStore over settings.adapter_dir
  state.services.adapters_active        ActiveAdapter (the engine hooks its swap into .callbacks)
  state.services.adapter_compose_cache  CompositionCache for chat `adapters:[{name, scale}]`
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive

from kiln.adapters.active import ActiveAdapter, model_spec_for, replace_adapter
from kiln.adapters.archive import import_error
from kiln.adapters.detail import adapter_detail_body
from kiln.adapters.importing import import_lora_path
from kiln.adapters.merge import merge_adapters
from kiln.adapters.peft_format import RECEIPT_FILE
from kiln.adapters.store import NAME_CODE, AdapterStore
from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import no_request_body, request_body
from kiln.api.state import get_state
from kiln.errors import KilnError

router = APIRouter(tags=["adapters"])

# Multipart framing and the `name` field ride on top of the archive bytes.
_MULTIPART_SLACK = 64 << 10



def _store(request: Request) -> AdapterStore:
    return get_state(request).services.adapter_store


def _active(request: Request) -> ActiveAdapter:
    return get_state(request).services.adapters_active


# -- bodies -----------------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoadBody(_Body):
    name: str
    allow_quarantined: bool = False


class VllmLoadBody(_Body):
    lora_name: str
    lora_path: str | None = None


class VllmUnloadBody(_Body):
    lora_name: str | None = None


class MergeSourceBody(_Body):
    name: str
    weight: float = 1.0

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class UploadForm(BaseModel):
    """POST /v1/adapters/upload's multipart fields (for the document: the handler reads the form)."""
    name: str = Field(description="the adapter's name here")
    archive: bytes = Field(description="tar.gz of a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors)")
    replace: bool = Field(False, description="swap an adapter stored under `name` for this one, in one step, once "
                          "it is stored and checked (any failure keeps the stored revision)")


class MergeBody(_Body):
    sources: list[MergeSourceBody]
    output_name: str
    mode: str | None = None
    density: float | None = None


# -- listing and inspection -------------------------------------------------------------------------

@router.get("/v1/adapters")
async def list_adapters(request: Request) -> dict[str, Any]:
    store, active = _store(request), _active(request)
    infos = await run_in_threadpool(store.list)
    return {"active": active.name, "available": [i.to_dict() for i in infos]}


@router.get("/v1/adapters/{name}/detail")
async def adapter_detail(name: str, request: Request) -> dict[str, Any]:
    store, active = _store(request), _active(request)
    engine = get_state(request).engine
    return await run_in_threadpool(adapter_detail_body, store, name, active.name, model_spec_for(engine))


@router.get("/v1/adapters/{name}/receipt")
async def adapter_receipt(name: str, request: Request) -> JSONResponse:
    path = _store(request).require(name) / RECEIPT_FILE
    try:
        return JSONResponse(json.loads(path.read_bytes()))
    except FileNotFoundError:
        raise KilnError(404, "adapter_not_found", f"Adapter {name!r} has no {RECEIPT_FILE}.", param="name",
                        hint="Only adapters trained by Kiln carry a training receipt.") from None
    except ValueError as e:
        raise KilnError(500, "adapter_receipt_failed", f"{RECEIPT_FILE} of {name!r} is not valid JSON: {e}",
                        param="name") from None


@router.get("/v1/adapters/{name}/download")
async def download_adapter(name: str, request: Request) -> StreamingResponse:
    chunks = _store(request).adapter_archive_bytes(name)
    disposition = f"attachment; filename*=UTF-8''{quote(name, safe='')}.tar.gz"
    return StreamingResponse(chunks, media_type="application/gzip", headers={"Content-Disposition": disposition})


# -- changing the store -----------------------------------------------------------------------------

def _bounded_receive(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise import_error(f"request body exceeds the limit of {limit} bytes")
        return message

    return wrapped


@router.post("/v1/adapters/upload")
@request_body(UploadForm, media="multipart/form-data")
async def upload_adapter(request: Request) -> dict[str, Any]:
    store = _store(request)
    limit = store.limits.max_body_bytes + _MULTIPART_SLACK
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise import_error(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise import_error("send multipart/form-data with fields `name` and `archive`", param="archive")
    bounded = Request(request.scope, _bounded_receive(request.receive, limit))
    try:
        form = await bounded.form(max_files=1, max_fields=16)
    except StarletteHTTPException as e:
        raise import_error(f"malformed multipart body: {e.detail}") from None
    try:
        name, archive = form.get("name"), form.get("archive")
        if not isinstance(name, str):
            raise KilnError(400, NAME_CODE, "The `name` form field is required.", param="name",
                            hint="Send multipart fields `name` (the new adapter's name) and `archive` (tar.gz).")
        if not isinstance(archive, UploadFile):
            raise import_error("the `archive` form field must be a file (tar.gz)")
        replaced = False
        if _replace_flag(form.get("replace")):
            info, replaced = await run_in_threadpool(replace_adapter, store, _active(request), archive.file, name,
                                                     model_spec_for(get_state(request).engine))
        else:
            info = await run_in_threadpool(store.extract_adapter_archive, archive.file, name)
    finally:
        await form.close()
    return {"status": "replaced" if replaced else "uploaded", **info.to_dict()}


def _replace_flag(value: object) -> bool:
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0", ""):
        return value.strip().lower() in ("true", "1")
    raise KilnError(400, "adapter_import_invalid", "The `replace` form field must be true or false.",
                    param="replace", hint="Send replace=true to swap a stored adapter for the uploaded revision.")


@router.delete("/v1/adapters/{name}")
async def delete_adapter(name: str, request: Request) -> dict[str, Any]:
    store, active = _store(request), _active(request)

    def delete() -> None:
        store.require(name)
        with active.lock:
            if active.name == name:
                raise KilnError(409, "adapter_active", f"Adapter {name!r} is the active adapter.", param="name",
                                hint="POST /v1/adapters/unload (or load another adapter) first.")
            store.delete(name)

    await run_in_threadpool(delete)
    return {"status": "deleted", "name": name}


@router.post("/v1/adapters/merge")
@request_body(MergeBody)
async def merge(request: Request) -> dict[str, Any]:
    prefix = "Invalid adapter merge: "
    body = parse_model(MergeBody, await read_json_body(request, code="adapter_merge_invalid", prefix=prefix),
                       code="adapter_merge_invalid", prefix=prefix)
    sources = [{"name": s.name, "weight": s.weight} for s in body.sources]
    return await run_in_threadpool(merge_adapters, _store(request), sources, body.output_name, body.mode,
                                   body.density)


# -- the active adapter -----------------------------------------------------------------------------

async def _load(request: Request, name: str) -> dict[str, Any]:
    active = _active(request)
    return await run_in_threadpool(active.load, name, model_spec_for(get_state(request).engine))


@router.post("/v1/adapters/load")
@request_body(LoadBody)
async def load_adapter(request: Request) -> dict[str, Any]:
    prefix = "Invalid adapter load request: "
    body = parse_model(LoadBody, await read_json_body(request, code=NAME_CODE, prefix=prefix),
                       code=NAME_CODE, prefix=prefix)
    return await _load(request, body.name)


@router.post("/v1/adapters/unload")
@no_request_body
async def unload_adapter(request: Request) -> dict[str, Any]:
    return await run_in_threadpool(_active(request).unload)


@router.post("/v1/load_lora_adapter")
@request_body(VllmLoadBody)
async def vllm_load(request: Request) -> dict[str, Any]:
    """vLLM's route: {lora_name, lora_path}. A `lora_path` outside the adapter directory is imported into
    the store under `lora_name` when `server.allow_external_lora_paths` is on (off by default, as vLLM
    gates runtime loading); otherwise it may only name the stored adapter's own folder."""
    prefix = "Invalid LoRA load request: "
    body = parse_model(VllmLoadBody, await read_json_body(request, code=NAME_CODE, prefix=prefix),
                       code=NAME_CODE, prefix=prefix)
    allow = get_state(request).settings.server.allow_external_lora_paths
    await run_in_threadpool(import_lora_path, _store(request), body.lora_name, body.lora_path, allow_external=allow)
    return await _load(request, body.lora_name)


@router.post("/v1/unload_lora_adapter")
@request_body(VllmUnloadBody, required=False)
async def vllm_unload(request: Request) -> JSONResponse:
    raw = await request.body()
    body = VllmUnloadBody()
    if raw.strip():
        prefix = "Invalid LoRA unload request: "
        body = parse_model(VllmUnloadBody, await read_json_body(request, code=NAME_CODE, prefix=prefix),
                           code=NAME_CODE, prefix=prefix)
    active = _active(request)
    if body.lora_name is not None and body.lora_name != active.name:
        _store(request).path(body.lora_name, param="lora_name")
        raise KilnError(404, "adapter_not_found", f"Adapter {body.lora_name!r} is not loaded.", param="lora_name",
                        hint="GET /v1/adapters shows the active adapter.")
    return JSONResponse(await run_in_threadpool(active.unload))
