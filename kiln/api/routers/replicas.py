"""Replica routes: GET/POST /v1/replicas, GET/DELETE /v1/replicas/{name}, POST /v1/replicas/{name}/check,
and publishing adapters to them: POST /v1/adapters/{name}/publish | unpublish, GET .../publications.

Service (built by kiln.server.build_server): state.services.replicas, a
kiln.replicas.service.ReplicaService over `[[replicas]]` and <data_dir>/replicas, whose health
poller starts with the server.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import no_request_body, request_body
from kiln.api.state import get_state
from kiln.replicas.publish import Publisher
from kiln.replicas.service import ReplicaService
from kiln.replicas.wiring import stored_adapter

router = APIRouter(tags=["replicas"])


class ReplicaBody(BaseModel):
    """A replica as POST /v1/replicas takes it (for the document: kiln.replicas.spec.parse_replica validates,
    with a 400 naming the bad field)."""
    model_config = ConfigDict(extra="forbid")
    name: str
    url: str = Field(description="the server's root (a trailing /v1 is dropped)")
    kind: Literal["kiln", "vllm", "openai"] = "kiln"
    api_key_env: str | None = Field(None, description="the environment variable holding its API key")
    max_concurrency: int = Field(8, ge=1, le=4096, description="requests in flight to it at once (eval fan-out)")
    base_model: str | None = Field(None, description="the id it serves our base model under (default: ours)")
    lora_dir: str | None = Field(None, description="vLLM: the folder adapters are written into for it")
    lora_dir_remote: str | None = Field(None, description="vLLM: lora_dir as the replica's process sees it")


class PublishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: list[str] | Literal["all"]
    # Kiln replicas: also make it the replica's default adapter (POST /v1/adapters/load). Off: the
    # replica serves it to requests that name it, as vLLM serves a loaded LoRA module.
    activate: bool = False


class UnpublishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: list[str] | Literal["all"] = "all"


def _service(request: Request) -> ReplicaService:
    return get_state(request).services.replicas


@router.get("/v1/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    return _service(request).list_view()


@router.post("/v1/replicas")
@request_body(ReplicaBody)
async def add_replica(request: Request) -> dict[str, Any]:
    body = await read_json_body(request, code="replica_invalid", prefix="Invalid replica: ")
    return await run_in_threadpool(_service(request).add, body)


@router.get("/v1/replicas/{name}")
async def get_replica(request: Request, name: str) -> dict[str, Any]:
    service = _service(request)
    return service.view(service.registry.get(name))


@router.post("/v1/replicas/{name}/check")
@no_request_body
async def check_replica(request: Request, name: str) -> dict[str, Any]:
    service = _service(request)
    await run_in_threadpool(service.check, name)
    return service.view(service.registry.get(name))


@router.delete("/v1/replicas/{name}")
async def delete_replica(request: Request, name: str) -> dict[str, Any]:
    return await run_in_threadpool(_service(request).remove, name)


# -- publishing adapters ------------------------------------------------------------------------------

_PUBLISH = {"code": "publish_invalid", "prefix": "Invalid publish request: "}


@router.post("/v1/adapters/{name}/publish")
@request_body(PublishBody)
async def publish_adapter(request: Request, name: str) -> JSONResponse:
    state = get_state(request)
    body = parse_model(PublishBody, await read_json_body(request, **_PUBLISH), **_PUBLISH)
    adapter = await run_in_threadpool(stored_adapter, state.services.adapter_store, state.settings, name)
    publisher = Publisher(state.services.replicas)
    result = await run_in_threadpool(publisher.publish, adapter, body.replicas, activate=body.activate)
    # 502: a replica took none of it after its retries (the body says which and why)
    return JSONResponse(result, status_code=502 if result["failed"] else 200)


@router.post("/v1/adapters/{name}/unpublish")
@request_body(UnpublishBody, required=False)
async def unpublish_adapter(request: Request, name: str) -> JSONResponse:
    state = get_state(request)
    raw = await request.body()
    body = parse_model(UnpublishBody, await read_json_body(request, **_PUBLISH), **_PUBLISH) if raw.strip() \
        else UnpublishBody()
    state.services.adapter_store.path(name)  # a bad name is a 400 before any replica is asked
    result = await run_in_threadpool(Publisher(state.services.replicas).unpublish, name, body.replicas)
    return JSONResponse(result, status_code=502 if result["failed"] else 200)


@router.get("/v1/adapters/{name}/publications")
async def adapter_publications(request: Request, name: str) -> dict[str, Any]:
    state = get_state(request)
    state.services.adapter_store.path(name)
    records = state.services.replicas.records
    return {"adapter": name, "replicas": records.for_adapter(name), "failed_pushes": records.failures_for_adapter(name)}
