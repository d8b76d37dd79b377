"""vLLM-compatible routes that are not in the contracts: tokenizer routes and legacy OpenAI completions.

lm-evaluation-harness finds everything from one base URL: with
`base_url=http://HOST:PORT/compat/v1/completions` its `local-completions` model posts there, and its
remote tokenizer (`tokenizer_backend=remote`) strips `/v1/completions` and calls
`/compat/tokenizer_info`, `/compat/tokenize`, `/compat/detokenize`. The tokenizer routes are also at
the root, where vLLM serves them. The contract's `POST /v1/completions` (prompt scoring) is unchanged.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kiln.api.access_log import note_request
from kiln.api.errors import parse_body, parse_model, read_json_body
from kiln.api.routers.metrics import counting_refusals, metrics_for
from kiln.api.state import get_state
from kiln.api.wire.compat import (
    MAX_PROMPTS,
    PREFIX,
    DetokenizeRequest,
    LegacyCompletionRequest,
    TokenizeRequest,
)
from kiln.core.sampling import resolve_sampling, validate_sampling
from kiln.engine.legacy_completion import LegacyPlan, LegacyPrompt, run_legacy_completion
from kiln.engine.model_selection import select_model
from kiln.engine.timing import now
from kiln.errors import KilnError

router = APIRouter(tags=["compat"])

CODE = "completion_invalid_request"
TOKENIZE_CODE = "tokenize_invalid_request"
MAX_SCORED_TOKENS = 4096


def _bad(message: str, param: str | None, hint: str, code: str = CODE) -> KilnError:
    return KilnError(400, code, PREFIX + message, param=param, hint=hint)


def _engine(request: Request) -> Any:
    return get_state(request).require_engine()


def _check_model(request: Request, model: str | None) -> None:
    """Tokenizer routes serve one tokenizer: the served model's (adapters share it)."""
    state = get_state(request)
    select_model(model, served_model_id=state.require_engine().info.served_model_id,
                 adapter_store=state.services.adapter_store)


# ---- tokenizer routes (vLLM's shapes) ------------------------------------------------------------------

def _tokenizer_info(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    tok = engine.tokenizer
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
        "unk_token": tok.unk_token, "model_max_length": engine.info.max_model_len,
        "vocab_size": tok.vocab_size, "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info


async def _tokenize(request: Request) -> dict[str, Any]:
    prefix = "Invalid tokenize request: "
    body = parse_model(TokenizeRequest, await read_json_body(request, code=TOKENIZE_CODE, prefix=prefix),
                       code=TOKENIZE_CODE, prefix=prefix)
    _check_model(request, body.model)
    engine = _engine(request)
    if (body.prompt is None) == (body.messages is None):
        raise KilnError(400, TOKENIZE_CODE, prefix + "send exactly one of prompt or messages", param="prompt",
                        hint='Send {"prompt": "text"} or {"messages": [...]}.')
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        try:
            text = engine.template.render(body.messages, add_generation_prompt=body.add_generation_prompt,
                                          **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the template's complaint is the client's to fix
            raise KilnError(400, TOKENIZE_CODE, f"{prefix}the chat template rejected the messages: {e}",
                            param="messages", hint="Send messages with role and content.") from None
        ids = engine.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [engine.tokenizer.id_to_token(i) for i in ids]
    return out


async def _detokenize(request: Request) -> dict[str, Any]:
    prefix = "Invalid detokenize request: "
    body = parse_model(DetokenizeRequest, await read_json_body(request, code=TOKENIZE_CODE, prefix=prefix),
                       code=TOKENIZE_CODE, prefix=prefix)
    _check_model(request, body.model)
    engine = _engine(request)
    _check_ids(body.tokens, engine.tokenizer.vocab_size, "tokens", TOKENIZE_CODE, prefix)
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def _check_ids(ids: list[int], vocab: int, param: str, code: str, prefix: str) -> None:
    for i, tid in enumerate(ids):
        if not 0 <= tid < vocab:
            raise KilnError(400, code, f"{prefix}token id {tid} is outside the vocabulary 0..{vocab - 1}",
                            param=f"{param}[{i}]", hint="Send token ids this model's tokenizer produces.")


for _base in ("", "/compat"):
    router.add_api_route(f"{_base}/tokenizer_info", _tokenizer_info, methods=["GET"],
                         summary="The served tokenizer's configuration (vLLM's shape)")
    router.add_api_route(f"{_base}/tokenize", _tokenize, methods=["POST"],
                         summary="Text or chat messages to token ids (vLLM's shape)")
    router.add_api_route(f"{_base}/detokenize", _detokenize, methods=["POST"],
                         summary="Token ids to text (vLLM's shape)")


# ---- legacy completions ----------------------------------------------------------------------------------

@router.post("/compat/v1/completions", summary="OpenAI legacy completions: generation, echo, logprobs")
async def legacy_completions(request: Request) -> JSONResponse:
    started = now()
    state = get_state(request)
    with counting_refusals(state, started):
        req = await parse_body(request, LegacyCompletionRequest, code=CODE, prefix=PREFIX)
        engine = state.require_engine()
        plan, model_id = _plan(engine, state, req)
        result = await run_legacy_completion(engine, plan, timeout_s=state.settings.server.request_timeout_secs)
    usage = result["usage"]
    note_request(model=model_id, adapter=plan.adapter.label if plan.adapter else "base",
                 prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                 finish_reason=",".join(sorted({c["finish_reason"] for c in result["choices"]})))
    metrics = metrics_for(state)
    if metrics is not None:
        metrics.finished("ok", now() - started)
    return JSONResponse({**result, "created": int(time.time()), "model": model_id})


def _plan(engine: Any, state: Any, req: LegacyCompletionRequest) -> tuple[LegacyPlan, str]:
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of other than n is not supported", "best_of", "Leave best_of out.")
    selection = select_model(req.model, served_model_id=engine.info.served_model_id,
                             adapter_store=state.services.adapter_store)
    target = engine.resolve_adapter(adapter_given=selection.adapter is not None, adapter=selection.adapter,
                                    adapters=None, param="model")
    wants_logprobs = req.logprobs is not None
    if wants_logprobs and target is not None:
        raise _bad(f"logprobs are computed on the base model only, and this request runs on adapter "
                   f"{target.label!r}", "logprobs",
                   "Drop logprobs, or score on the base model (unload the default adapter).")
    prompts = _prompts(engine, req)
    params = resolve_sampling(req.explicit_sampling(), preset=None, qwen3_family=engine.info.qwen3_family,
                              has_tools=False, model_defaults=engine.info.generation_defaults, eval_mode=state.settings.server.eval_mode)
    validate_sampling(params, code=CODE)
    params.stop = req.stop_list()
    params.ignore_eos = req.ignore_eos
    ceiling = engine.info.max_model_len
    wanted = 16 if req.max_tokens is None else req.max_tokens
    max_tokens = []
    for i, p in enumerate(prompts):
        if len(p.ids) > ceiling or (wanted > 0 and len(p.ids) >= ceiling):
            raise KilnError(400, "context_length_exceeded",
                            f"This model's maximum context length is {ceiling} tokens. However, prompt {i} has "
                            f"{len(p.ids)} tokens (plus {wanted} for max_tokens).", param="prompt",
                            hint="Send a shorter prompt.")
        max_tokens.append(min(wanted, ceiling - len(p.ids)))
        if wants_logprobs and len(p.ids) + max_tokens[-1] > MAX_SCORED_TOKENS:
            raise _bad(f"prompt {i} plus its completion exceeds {MAX_SCORED_TOKENS} tokens, the most that "
                       "logprobs are computed over", "logprobs", "Send a shorter prompt or fewer max_tokens.")
    plan = LegacyPlan(prompts, params, max_tokens, req.n, req.echo, req.logprobs, target)
    return plan, selection.model_id


def _prompts(engine: Any, req: LegacyCompletionRequest) -> list[LegacyPrompt]:
    raw = req.prompts()
    if not raw:
        raise _bad("prompt is empty", "prompt", "Send a string, a list of strings, or token ids.")
    if len(raw) > MAX_PROMPTS:
        raise _bad(f"{len(raw)} prompts; at most {MAX_PROMPTS} per request", "prompt", "Split the request.")
    vocab = min(engine.tokenizer.vocab_size, engine.info.config.vocab_size)
    out = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            ids = engine.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
            text = p
        else:
            _check_ids(p, vocab, f"prompt[{i}]", CODE, PREFIX)
            ids, text = list(p), engine.tokenizer.decode(p)
        if not ids:
            raise _bad(f"prompt {i} has no tokens", "prompt", "Send non-empty prompts.")
        out.append(LegacyPrompt(ids, text))
    return out
