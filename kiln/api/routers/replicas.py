"""Replica routes: GET/POST /v1/replicas, GET/DELETE /v1/replicas/{name}, POST /v1/replicas/{name}/check.

Service (built once by `ensure_replicas`, which `init` calls): state.services.replicas, a
kiln.replicas.service.ReplicaService over `[[replicas]]` and <data_dir>/replicas, whose health
poller starts with the app.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from kiln.api.errors import read_json_body
from kiln.api.state import ServerState, get_state
from kiln.replicas.compat import LocalModel
from kiln.replicas.service import ReplicaService, replica_root

router = APIRouter(tags=["replicas"])


def local_model(state: ServerState) -> LocalModel:
    engine = state.engine
    if engine is None:
        return LocalModel(None, None)
    identity = getattr(engine, "identity", None)
    return LocalModel(engine.info.served_model_id, identity.base_model_sha256 if identity is not None else None)


def ensure_replicas(state: ServerState) -> ReplicaService:
    if state.services.replicas is None:
        settings = state.settings
        service = ReplicaService(replica_root(settings.data.data_dir), settings.replicas,
                                 lambda: local_model(state))
        service.health.start()
        state.lifecycle.on_drain.append(service.health.stop)
        state.services.replicas = service
    return state.services.replicas


def init(state: ServerState) -> None:
    ensure_replicas(state)


def _service(request: Request) -> ReplicaService:
    return ensure_replicas(get_state(request))


@router.get("/v1/replicas")
async def list_replicas(request: Request) -> dict[str, Any]:
    return _service(request).list_view()


@router.post("/v1/replicas")
async def add_replica(request: Request) -> dict[str, Any]:
    body = await read_json_body(request, code="replica_invalid", prefix="Invalid replica: ")
    return await run_in_threadpool(_service(request).add, body)


@router.get("/v1/replicas/{name}")
async def get_replica(request: Request, name: str) -> dict[str, Any]:
    service = _service(request)
    return service.view(service.registry.get(name))


@router.post("/v1/replicas/{name}/check")
async def check_replica(request: Request, name: str) -> dict[str, Any]:
    service = _service(request)
    await run_in_threadpool(service.check, name)
    return service.view(service.registry.get(name))


@router.delete("/v1/replicas/{name}")
async def delete_replica(request: Request, name: str) -> dict[str, Any]:
    return await run_in_threadpool(_service(request).remove, name)
