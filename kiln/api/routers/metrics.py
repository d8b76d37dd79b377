"""GET /metrics: Prometheus text exposition of kiln/api/metrics.py's series."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from kiln.api.metrics import metrics_for
from kiln.api.services import ensure_metrics
from kiln.api.state import ServerState, get_state

router = APIRouter(tags=["observability"])


def init(state: ServerState) -> None:
    # `*_created` timestamp series double the exposition and no dashboard reads them
    disable_created_metrics()
    ensure_metrics(state)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = metrics_for(get_state(request))
    body = generate_latest(m.registry) if m is not None else b""
    return Response(body, media_type=CONTENT_TYPE_LATEST)
