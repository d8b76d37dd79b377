"""Health (semantics.md §13.2), model listing, and the effective configuration (GET /v1/config); the
bodies are composed in kiln.api.system_views."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.state import get_state
from kiln.api.system_views import config_view, health_view, models_view

router = APIRouter(tags=["observability"])


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> JSONResponse:
    body, status = health_view(get_state(request))
    return JSONResponse(body, status_code=status)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(models_view(get_state(request)))


@router.get("/v1/config")
async def effective_config(request: Request) -> JSONResponse:
    """Settings after every layer (flags > env > TOML > defaults), the thinking-budget defaults, the
    sampling a request without sampling fields gets, and the content hashes of what is served."""
    return JSONResponse(config_view(get_state(request)))
