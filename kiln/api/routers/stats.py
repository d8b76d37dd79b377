"""Live statistics: GET /v1/stats/recent-requests (the last finished requests, newest first; `?limit=`,
`?status=ok|rejected|error|timeout|cancelled`, `?kind=chat|batch`) and GET /v1/stats/decode.

Services (built by `init` unless a test put its own first):
  state.services["recorder"]   CompletionRecorder: the recent-request ring, the request log when
                               `[request_log] enabled`, and the Prometheus listener (kiln.engine.records)
The chat and batch routes hand every finished request to the recorder; the decode window lives on
the engine actor (`actor.decode_stats`), which feeds it once per model step.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.routers.metrics import metrics_for
from kiln.api.state import ServerState, get_state
from kiln.engine.records import STATUSES, CompletionRecorder, RecentRequests
from kiln.errors import KilnError
from kiln.store.request_log import RequestLog

router = APIRouter(tags=["observability"])
SERVICE = "recorder"


def build_recorder(state: ServerState) -> CompletionRecorder:
    settings = state.settings
    rl = settings.request_log
    request_log = None
    if rl.enabled:
        request_log = RequestLog(settings.request_log_dir, max_file_bytes=rl.max_file_bytes,
                                 max_total_bytes=rl.max_total_bytes, compress=rl.compress,
                                 max_row_bytes=rl.max_capture_bytes, queue_rows=rl.queue_rows)
    metrics = metrics_for(state)
    return CompletionRecorder(RecentRequests(settings.stats.recent_requests), request_log,
                              listeners=[metrics.observe_record] if metrics is not None else [])


def init(state: ServerState) -> None:
    if SERVICE not in state.services:
        state.services[SERVICE] = build_recorder(state)


def recorder_for(state: ServerState) -> CompletionRecorder | None:
    return state.services.get(SERVICE)


def _limit(request: Request, capacity: int) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return capacity
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KilnError(400, "invalid_request", f"limit must be a positive integer, got {raw!r}", param="limit",
                        hint=f"Send ?limit=N with 1 <= N; the ring holds at most {capacity}.")
    return min(value, capacity)


@router.get("/v1/stats/recent-requests")
async def recent_requests(request: Request) -> JSONResponse:
    state = get_state(request)
    recorder = recorder_for(state)
    if recorder is None:
        return JSONResponse({"object": "list", "data": [], "capacity": 0})
    ring = recorder.ring
    limit = _limit(request, ring.capacity)
    status = _choice(request, "status", STATUSES)
    kind = _choice(request, "kind", ("chat", "batch"))
    preview = state.settings.stats.preview_chars
    rows = [r for r in ring.list() if (status is None or r.status == status) and (kind is None or r.kind == kind)]
    return JSONResponse({"object": "list", "data": [r.recent(preview) for r in rows[:limit]],
                         "capacity": ring.capacity})


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    value = request.query_params.get(name)
    if value is not None and value not in allowed:
        raise KilnError(400, "invalid_request", f"{name} must be one of {', '.join(allowed)}, got {value!r}",
                        param=name, hint=f"Send ?{name}={allowed[0]}, or leave it out for all.")
    return value


@router.get("/v1/stats/decode")
async def decode_stats(request: Request) -> JSONResponse:
    engine = get_state(request).engine
    if engine is None:
        raise KilnError(503, "model_loading", "the model is still loading", hint="Retry when GET /health answers 200.",
                        headers={"Retry-After": "5"})
    snap = engine.actor.decode_stats.snapshot(time.perf_counter())
    sched = engine.scheduler_snapshot()
    total = sched["blocks_total"]
    return JSONResponse({
        "object": "kiln.decode_stats", **snap.to_dict(),
        "running": sched["running"], "waiting": sched["waiting"],
        "kv_cache_usage": round(sched["blocks_used"] / total, 6) if total else 0.0,
        "kv_blocks_used": sched["blocks_used"], "kv_blocks_total": total,
    })
