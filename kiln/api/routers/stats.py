"""Live statistics: GET /v1/stats/recent-requests (the last finished requests, newest first; `?limit=`,
`?status=ok|rejected|error|timeout|cancelled`, `?kind=chat|batch`) and GET /v1/stats/decode.

Services (built by kiln.server.build_server):
  state.services.recorder   CompletionRecorder: the recent-request ring, the request log when
                            `[request_log] enabled`, and the Prometheus listener (kiln.traffic.records)
Every completion reaches the recorder through `Engine.finish_completion` -> `ServerState.completion_finished`;
a request refused before the engine took it through `recording_refusals` (the chat and batch routes).
The decode window lives on the engine actor (`actor.decode_stats`), which feeds it once per model step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.access_log import current_request_id, new_request_id
from kiln.api.state import ServerState, get_state
from kiln.core.thinking_budget import resolve_budget
from kiln.engine.chat_response import status_of
from kiln.engine.timing import now
from kiln.errors import KilnError, model_loading
from kiln.traffic.records import STATUSES, CompletionRecorder, rejected_record

router = APIRouter(tags=["observability"])



def recorder_for(state: ServerState) -> CompletionRecorder | None:
    return state.services.recorder


# ---- what the inference routes call ------------------------------------------------------------------

def client_request_id(request: Request) -> str:
    """The request's id: the client's `x-request-id` as RequestIdMiddleware took (and echoes) it, else a
    fresh one (an app built without the middleware)."""
    return current_request_id() or new_request_id()


@dataclass
class Seen:
    """What a route learned about a request before it failed (recorded by `recording_refusals`)."""

    request_id: str
    inp: Any = None                 # kiln.engine.chat_request.ChatInput, once parsed
    prompts: list | None = None     # a batch's conversations


@contextlib.contextmanager
def recording_refusals(state: ServerState, request: Request, started: float, kind: str) -> Iterator[Seen]:
    """A request that parsed but was refused before the engine took it still gets a recent-request
    record (status rejected/error, finish_reason "error", the budget as far as it resolved)."""
    seen = Seen(client_request_id(request))
    try:
        yield seen
    except Exception as e:
        recorder = state.services.recorder
        if recorder is not None and seen.inp is not None:
            try:
                budget: dict[str, Any] | None = resolve_budget(seen.inp.budget_fields, state.settings.server).to_dict()
            except KilnError:
                budget = None  # the budget fields themselves were the problem
            engine = state.engine
            recorder.finished(rejected_record(
                kind, seen.inp, model=engine.info.served_model_id if engine is not None else "",
                request_id=seen.request_id, status=status_of(e.status) if isinstance(e, KilnError) else "error",
                error=e.message if isinstance(e, KilnError) else f"{type(e).__name__}: {e}",
                duration_ms=(now() - started) * 1000.0, budget=budget, prompts=seen.prompts))
        raise


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
