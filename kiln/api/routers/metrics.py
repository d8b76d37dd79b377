"""GET /metrics: Prometheus text exposition of kiln/api/metrics.py's series."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kiln.api.state import get_state

router = APIRouter(tags=["observability"])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(get_state(request).services.metrics.registry), media_type=CONTENT_TYPE_LATEST)
