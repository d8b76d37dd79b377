"""Replica routes: GET/POST /v1/replicas, GET/DELETE /v1/replicas/{name}, POST /v1/replicas/{name}/check,
and publishing adapters to them: POST /v1/adapters/{name}/publish | unpublish, GET .../publications.

Service (built once by `ensure_replicas`, which `init` calls): state.services.replicas, a
kiln.replicas.service.ReplicaService over `[[replicas]]` and <data_dir>/replicas, whose health
poller starts with the app.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from kiln.adapters.export import base_model_reference
from kiln.api.errors import parse_model, read_json_body
from kiln.api.services import ensure_adapters, ensure_training
from kiln.api.state import ServerState, get_state
from kiln.errors import KilnError
from kiln.replicas.compat import LocalModel
from kiln.replicas.evals import ReplicaFanOut, placement_root
from kiln.replicas.publish import Publisher
from kiln.replicas.push import Adapter
from kiln.replicas.service import ReplicaService, replica_root

router = APIRouter(tags=["replicas"])
log = logging.getLogger("kiln.replicas")


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


def publish_on_pass(state: ServerState, job: Any) -> None:
    """A training job's terminal-state listener: a passed gate with post_eval.publish_on_pass publishes the
    adapter (on a thread: pushes take network time); the outcome is logged and kept in the records."""
    replicas = (job.post_eval or {}).get("publish_on_pass")
    if replicas is None or job.gate_outcome not in ("promoted", "kept"):
        return

    def run() -> None:
        try:
            result = Publisher(ensure_replicas(state)).publish(stored_adapter(state, job.adapter_name), replicas)
            log.info("training job %s: published %s to %s: %s", job.job_id, job.adapter_name,
                     ", ".join(result["replicas"]), result["status"])
        except KilnError as e:
            log.warning("training job %s: publishing %s on pass failed: %s", job.job_id, job.adapter_name, e.message)
        except Exception:  # noqa: BLE001 - a thread's failure is logged, never lost
            log.exception("training job %s: publishing on pass failed", job.job_id)

    threading.Thread(target=run, name="kiln-publish-on-pass", daemon=True).start()


def init(state: ServerState) -> None:
    store = ensure_adapters(state)
    service = ensure_replicas(state)
    if state.services.eval_jobs is not None:
        training = ensure_training(state)
        if not any(getattr(f, "__name__", "") == "publish_after_gate" for f in training.listeners):
            def publish_after_gate(job: Any) -> None:
                publish_on_pass(state, job)

            training.listeners.append(publish_after_gate)
    if state.services.eval_jobs is not None and state.services.eval_jobs.fanout is None:
        # evals that name `replicas` fan out over them (kiln.replicas.evals)
        state.services.eval_jobs.fanout = ReplicaFanOut(
            service, placement_root(state.settings.data.data_dir),
            local_capacity=state.settings.engine.max_num_seqs, revision=store.content_hash,
            local_model_name=lambda: local_model(state).name)


class PublishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: list[str] | Literal["all"]
    # Kiln replicas: also make it the replica's default adapter (POST /v1/adapters/load). Off: the
    # replica serves it to requests that name it, as vLLM serves a loaded LoRA module.
    activate: bool = False


class UnpublishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: list[str] | Literal["all"] = "all"


def stored_adapter(state: ServerState, name: str) -> Adapter:
    from kiln.model.loader import default_model_path

    store = ensure_adapters(state)
    folder = store.require(name)
    model_path = state.settings.model.path
    ref = base_model_reference(model_path or str(default_model_path()), embedded=model_path is None)
    return Adapter(name=name, folder=folder, revision=store.content_hash(name),
                   archive=lambda: b"".join(store.adapter_archive_bytes(name)), base_model=ref.hf)


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


# -- publishing adapters ------------------------------------------------------------------------------

_PUBLISH = {"code": "publish_invalid", "prefix": "Invalid publish request: "}


@router.post("/v1/adapters/{name}/publish")
async def publish_adapter(request: Request, name: str) -> JSONResponse:
    state = get_state(request)
    body = parse_model(PublishBody, await read_json_body(request, **_PUBLISH), **_PUBLISH)
    adapter = await run_in_threadpool(stored_adapter, state, name)
    publisher = Publisher(ensure_replicas(state))
    result = await run_in_threadpool(publisher.publish, adapter, body.replicas, activate=body.activate)
    # 502: a replica took none of it after its retries (the body says which and why)
    return JSONResponse(result, status_code=502 if result["failed"] else 200)


@router.post("/v1/adapters/{name}/unpublish")
async def unpublish_adapter(request: Request, name: str) -> JSONResponse:
    state = get_state(request)
    raw = await request.body()
    body = parse_model(UnpublishBody, await read_json_body(request, **_PUBLISH), **_PUBLISH) if raw.strip() \
        else UnpublishBody()
    ensure_adapters(state).path(name)  # a bad name is a 400 before any replica is asked
    result = await run_in_threadpool(Publisher(ensure_replicas(state)).unpublish, name, body.replicas)
    return JSONResponse(result, status_code=502 if result["failed"] else 200)


@router.get("/v1/adapters/{name}/publications")
async def adapter_publications(request: Request, name: str) -> dict[str, Any]:
    state = get_state(request)
    ensure_adapters(state).path(name)
    return {"adapter": name, "replicas": ensure_replicas(state).records.for_adapter(name)}
