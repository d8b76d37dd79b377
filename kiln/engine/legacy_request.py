"""Preparing a legacy OpenAI completions request (`/compat/v1/completions`) for the engine: the model
or adapter it names, its prompts as token ids, sampling, and the per-prompt token budget. The router
parses the wire body (kiln.api.wire.compat.LegacyCompletionRequest) and hands it here; the plan goes to
kiln.engine.legacy_completion.run_legacy_completion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.core.sampling import resolve_sampling, validate_sampling
from kiln.engine.chat_request import compile_output_grammar
from kiln.engine.legacy_completion import LegacyPlan, LegacyPrompt
from kiln.engine.model_selection import select_model
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

CODE = "completion_invalid_request"
PREFIX = "Invalid completion request: "
MAX_PROMPTS = 256
# Prompt + completion tokens that one logprobs request may score in its causal forward.
MAX_SCORED_TOKENS = 4096


def _bad(message: str, param: str | None, hint: str) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param, hint=hint)


def check_token_ids(ids: list[int], vocab: int, param: str, code: str, prefix: str) -> None:
    """400 naming the first id outside 0..vocab-1."""
    for i, tid in enumerate(ids):
        if not 0 <= tid < vocab:
            raise KilnError(400, code, f"{prefix}token id {tid} is outside the vocabulary 0..{vocab - 1}",
                            param=f"{param}[{i}]", hint="Send token ids this model's tokenizer produces.")


def prepare_legacy(engine: EngineView, req: Any, adapter_store: Any, eval_mode: bool) -> tuple[LegacyPlan, str]:
    """(the plan, the model id the response names) for a validated LegacyCompletionRequest."""
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of other than n is not supported", "best_of", "Leave best_of out.")
    selection = select_model(req.model, served_model_id=engine.info.served_model_id, adapter_store=adapter_store)
    target = engine.resolve_adapter(adapter_given=selection.adapter is not None, adapter=selection.adapter,
                                    adapters=None, param="model")
    wants_logprobs = req.logprobs is not None
    prompts = _prompts(engine, req)
    params = resolve_sampling(req.explicit_sampling(), preset=None, qwen3_family=engine.info.qwen3_family,
                              has_tools=False, model_defaults=engine.info.generation_defaults, eval_mode=eval_mode)
    validate_sampling(params, code=CODE)
    params.stop = req.stop_list()
    params.ignore_eos = req.ignore_eos
    grammar = compile_output_grammar(engine.prompt_context(), req.output_fields(), stops=params.stop, code=CODE, prefix=PREFIX)
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
    return LegacyPlan(prompts, params, max_tokens, req.n, req.echo, req.logprobs, target,
                      grammar=grammar), selection.model_id


def _prompts(engine: EngineView, req: Any) -> list[LegacyPrompt]:
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
            check_token_ids(p, vocab, f"prompt[{i}]", CODE, PREFIX)
            ids, text = list(p), engine.tokenizer.decode(p)
        if not ids:
            raise _bad(f"prompt {i} has no tokens", "prompt", "Send non-empty prompts.")
        out.append(LegacyPrompt(ids, text))
    return out
