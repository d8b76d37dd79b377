"""POST /v1/completions: prompt-logprob scoring only, no generation (semantics.md §5.2).

Parse, then `kiln.engine.score_request`: the checks that need the served model, the forward on the
actor thread between batching steps, and the response body.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.errors import parse_body
from kiln.api.state import get_state
from kiln.api.wire.completions import PREFIX, TextCompletionRequest
from kiln.engine.score_request import CODE, ScoreInput, prepare_score, score_prompt
from kiln.engine.timing import now

router = APIRouter(tags=["inference"])


@router.post("/v1/completions")
async def completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    with state.services.traffic.refusals(started):
        req = await parse_body(request, TextCompletionRequest, code=CODE, prefix=PREFIX)
        engine = state.require_engine()
        ids = prepare_score(engine, ScoreInput(req.prompt, req.prompt_logprobs, req.model, req.add_special_tokens),
                            active_adapter=state.services.active_adapter_name())
        result = await score_prompt(engine, ids, req.prompt_logprobs, state.settings.server.request_timeout_secs,
                                    engine.admit([len(ids)]))
    state.services.traffic.served(started)
    return JSONResponse(result)
