"""Live statistics: GET /v1/stats/recent-requests (the last finished requests, newest first; `?limit=`,
`?status=ok|rejected|error|timeout|cancelled`, `?kind=chat|batch`) and GET /v1/stats/decode.

Services (built by kiln.server.build_server):
  state.services.recorder   CompletionRecorder: the recent-request ring, the request log when
                            `[request_log] enabled`, and the Prometheus listener (kiln.traffic.records)
Every completion reaches the recorder through `Engine.finish_completion` -> the server's traffic observer
(kiln.api.observer.TrafficObserver.completion_finished); a request refused before the engine took it
through `TrafficObserver.refusals` (the chat and batch routes).
The decode window lives on the engine actor (`actor.decode_stats`), which feeds it once per model step.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.state import ServerState, get_state
from kiln.errors import KilnError, model_loading
from kiln.traffic.records import STATUSES, CompletionRecorder

router = APIRouter(tags=["observability"])


def recorder_for(state: ServerState) -> CompletionRecorder | None:
    return state.services.recorder


# ---- routes -------------------------------------------------------------------------------------------

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


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    value = request.query_params.get(name)
    if value is not None and value not in allowed:
        raise KilnError(400, "invalid_request", f"{name} must be one of {', '.join(allowed)}, got {value!r}",
                        param=name, hint=f"Send ?{name}={allowed[0]}, or leave it out for all.")
    return value


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
    return JSONResponse({"object": "list", "data": ring.rows(limit, status=status, kind=kind),
                         "capacity": ring.capacity})

@router.get("/v1/stats/decode")
async def decode_stats(request: Request) -> JSONResponse:
    engine = get_state(request).engine
    if engine is None:
        raise model_loading()
    snap = engine.decode_stats()
    sched = engine.scheduler_snapshot()
    total = sched["blocks_total"]
    return JSONResponse({
        "object": "kiln.decode_stats", **snap.to_dict(),
        "running": sched["running"], "waiting": sched["waiting"],
        "kv_cache_usage": round(sched["blocks_used"] / total, 6) if total else 0.0,
        "kv_blocks_used": sched["blocks_used"], "kv_blocks_total": total,
    })
