"""Health and model listing."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln import __version__
from kiln.api.state import get_state

router = APIRouter(tags=["observability"])


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    engine = state.engine
    ready = engine is not None and state.load_error is None
    body = {
        "status": "ok" if ready else "degraded",
        "version": __version__,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "model": engine.describe() if engine is not None else None,
        "checks": [
            {"name": "model_loaded", "pass": engine is not None},
            {"name": "scheduler_responsive", "pass": bool(engine is not None and engine.is_alive())},
        ],
    }
    if state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    engine = state.engine
    data = []
    if engine is not None:
        data.append({"id": engine.info.served_model_id, "object": "model", "created": engine.info.created,
                     "owned_by": "kiln"})
    return JSONResponse({"object": "list", "data": data})
