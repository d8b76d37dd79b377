"""Prompt scoring (POST /v1/completions, semantics.md §5.2): checks that need the served model, the
forward on the actor thread (bounded by server.request_timeout_secs), and the `text_completion` body."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from kiln.engine.chat_response import usage
from kiln.engine.scoring import prompt_logprob_entries
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.serving import Admission, Engine

MAX_PROMPT_TOKENS = 4096
MAX_RETURNED_CANDIDATES = 65_536
CODE = "completion_invalid_request"
PREFIX = "Invalid completion request: "


@dataclass
class ScoreInput:
    prompt: str | list[int]
    prompt_logprobs: int
    model: str | None = None
    add_special_tokens: bool = True


def _bad(message: str, param: str, hint: str) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param, hint=hint)


def prepare_score(engine: Engine, inp: ScoreInput, *, active_adapter: str | None) -> list[int]:
    """The prompt's token ids, once every rule that needs the served model holds."""
    if inp.model is not None and inp.model != engine.info.served_model_id:
        raise _bad(f"model {inp.model!r} is not the served base model {engine.info.served_model_id!r}", "model",
                   "Send the id GET /v1/models lists, or leave model out.")
    vocab = engine.info.config.vocab_size
    if inp.prompt_logprobs > vocab:
        raise _bad(f"prompt_logprobs {inp.prompt_logprobs} exceeds the vocabulary size {vocab}", "prompt_logprobs",
                   f"Ask for at most {vocab} candidates.")
    if active_adapter:
        raise _bad(f"adapter {active_adapter!r} is active; prompt scoring runs on the base model only", "model",
                   "Unload the adapter (POST /v1/adapters/unload) before scoring.")
    ids = _prompt_ids(engine, inp)
    k = inp.prompt_logprobs
    returned = (len(ids) - 1) * (k + 1)
    if returned > MAX_RETURNED_CANDIDATES:
        raise _bad(f"{len(ids) - 1} scored positions x {k + 1} candidates = {returned} exceeds the cap of "
                   f"{MAX_RETURNED_CANDIDATES}", "prompt_logprobs", "Ask for fewer candidates or a shorter prompt.")
    return ids


def _prompt_ids(engine: Engine, inp: ScoreInput) -> list[int]:
    """Tokenize (text) or check (token ids) the prompt against the served vocabulary and limits."""
    vocab = engine.info.config.vocab_size
    if isinstance(inp.prompt, str):
        ids = engine.tokenizer.encode(inp.prompt, add_special_tokens=inp.add_special_tokens)
    else:
        ids = list(inp.prompt)
        for i, tid in enumerate(ids):
            if not 0 <= tid < vocab:
                raise _bad(f"token id {tid} is outside the served vocabulary 0..{vocab - 1}", f"prompt[{i}]",
                           "Send token ids this model's tokenizer produces.")
    if not ids:
        raise _bad("the prompt is empty", "prompt", "Send non-empty text or at least one token id.")
    ceiling = engine.info.max_model_len
    if len(ids) > ceiling:
        raise KilnError(400, "context_length_exceeded",
                        f"This model's maximum context length is {ceiling} tokens. However, your prompt resulted "
                        f"in {len(ids)} tokens.", param="prompt", hint="Score a shorter prompt.")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise _bad(f"the prompt has {len(ids)} tokens; scoring takes at most {MAX_PROMPT_TOKENS}", "prompt",
                   "Score a shorter prompt, or split it.")
    return ids


async def score_prompt(engine: Engine, ids: list[int], k: int, timeout_s: float,
                       admission: Admission | None = None) -> dict[str, Any]:
    """A `text_completion` body whose one choice carries the prompt log-probs. `admission` (the place
    `Engine.admit` gave it) is given back once the scores are in, or on failure."""
    try:
        scores = await asyncio.wait_for(engine.score(ids, k), timeout=timeout_s)
    except TimeoutError:
        raise KilnError(408, "request_timeout", f"prompt scoring did not finish within {timeout_s:g}s",
                        hint="Retry later or score a shorter prompt.") from None
    finally:
        if admission is not None:
            admission.release()
    # up to 65,536 small decodes: off the event loop
    entries = await run_in_threadpool(prompt_logprob_entries, ids, scores, engine.tokenizer)
    identity = engine.identity
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.info.served_model_id,
        "system_fingerprint": identity.base_model_sha256 if identity is not None else None,
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_logprobs": entries}],
        "usage": usage(len(ids), 0),
    }
