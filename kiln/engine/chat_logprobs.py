"""OpenAI chat `logprobs` for /compat/v1/chat/completions: the generated tokens scored the way the
contract's prompt-scoring route scores them (one dense forward over prompt + completion, under the same
adapter), so the two agree for the same tokens. The contract's closed `Choice` has no room for them.

Each generated token becomes `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}` (top_logprobs: the `top_logprobs` best, 0-20); the EOS that ended a choice is not
listed, as OpenAI lists only what the message says. Reasoning tokens are listed too, in order.

Streamed, each chunk carries the logprobs of its own tokens: those of every engine event from the one
after the previous chunk's up to its own (text a detokenizer or parser holds back goes with the chunk that
shows it). Tokens are scored in blocks of `STREAM_BLOCK_TOKENS` as they arrive (prompt plus everything so
far, one forward each), so chunks trail generation by at most one block; tokens no chunk shows (an
unfinished byte sequence at the end) go in one chunk before the finish chunk. Scoring a prefix agrees with
scoring the whole to float rounding (~1e-6).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kiln.engine.chat_response import ChoiceOutput, complete_chat, stream_chat
from kiln.engine.legacy_request import MAX_SCORED_TOKENS
from kiln.engine.scoring import prompt_logprob_entries
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.chat_request import PreparedChat
    from kiln.engine.serving import Admission, Engine

MAX_TOP_LOGPROBS = 20
STREAM_BLOCK_TOKENS = 16


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def listed_tokens(out: ChoiceOutput, stop_ids: list[int]) -> list[int]:
    """The generated tokens the logprobs list: all but an ending EOS."""
    ids = list(out.token_ids)
    if ids and out.finish_reason == "stop" and ids[-1] in stop_ids:
        ids.pop()
    return ids


async def _content(engine: Engine, prep: PreparedChat, generated: list[int], top: int,
                   timeout_s: float) -> list[dict[str, Any]]:
    """The logprob entries of `generated`, scored after the prompt in one dense forward."""
    if not generated:
        return []
    ids = prep.prompt_ids + generated
    try:
        scores = await asyncio.wait_for(engine.score(ids, top, prep.adapter), timeout=timeout_s)
    except TimeoutError:
        raise KilnError(408, "request_timeout", f"scoring the logprobs did not finish within {timeout_s:g}s",
                        hint="Retry later, or ask for fewer tokens.") from None
    entries = prompt_logprob_entries(ids, scores, engine.tokenizer)
    content = []
    for p in range(len(prep.prompt_ids), len(ids)):
        entry = entries[p]
        assert entry is not None
        observed = entry[str(ids[p])]
        ranked = sorted(entry.values(), key=lambda e: e["rank"])[:top]
        item = _entry(observed["decoded_token"], observed["logprob"])
        item["top_logprobs"] = [_entry(e["decoded_token"], e["logprob"]) for e in ranked if e["rank"] <= top]
        content.append(item)
    return content


async def chat_logprobs(engine: Engine, prep: PreparedChat, out: ChoiceOutput, top: int,
                        timeout_s: float) -> dict[str, Any]:
    """`{"content": [...]}` for one choice."""
    return {"content": await _content(engine, prep, listed_tokens(out, prep.params[0].stop_token_ids), top,
                                      timeout_s)}


def check_scorable(prep: PreparedChat, *, code: str, prefix: str) -> None:
    """Scoring runs one dense forward over prompt + completion: its length is bounded."""
    longest = len(prep.prompt_ids) + max(p.max_tokens for p in prep.params)
    if longest > MAX_SCORED_TOKENS:
        raise KilnError(400, code, f"{prefix}prompt plus max_tokens is {longest} tokens; logprobs are computed over "
                        f"at most {MAX_SCORED_TOKENS}", param="logprobs",
                        hint="Send a shorter conversation or a smaller max_tokens.")


async def complete_chat_with_logprobs(engine: Engine, prep: PreparedChat, admission: Admission | None,
                                      top: int | None, timeout_s: float) -> dict[str, Any]:
    """A `chat.completion` body whose choices carry OpenAI's `logprobs` (null when not asked for)."""
    outs: list[ChoiceOutput] = []
    body = await complete_chat(engine, prep, admission, outs)
    for choice, out in zip(body["choices"], outs, strict=True):
        choice["logprobs"] = None if top is None else await chat_logprobs(engine, prep, out, top, timeout_s)
    return body


def stream_chat_with_logprobs(engine: Engine, prep: PreparedChat, admission: Admission | None, top: int | None,
                              timeout_s: float) -> AsyncIterator[dict[str, str]]:
    """The streamed completion; asked-for logprobs ride on the chunks whose tokens they score."""
    if top is None:
        return stream_chat(engine, prep, admission)

    async def annotate(events: AsyncIterator[dict[str, str]], out: ChoiceOutput) -> AsyncIterator[dict[str, str]]:
        scored: list[dict[str, Any]] = []
        held: list[tuple[dict[str, str], int]] = []   # (event, tokens generated when it was made)
        attached = 0

        async def score(generated: list[int]) -> None:
            if len(generated) > len(scored):
                scored.extend((await _content(engine, prep, generated, top, timeout_s))[len(scored):])

        def release(upto: float) -> list[dict[str, str]]:
            nonlocal attached
            ready = []
            while held and held[0][1] <= upto:
                event, made_at = held.pop(0)
                body = _chunk_body(event)
                if body is not None and body["choices"] and "delta" in body["choices"][0]:
                    mine = scored[attached:made_at]
                    attached = max(attached, min(made_at, len(scored)))
                    body["choices"][0]["logprobs"] = {"content": mine} if mine else None
                    event = {"data": json.dumps(body, ensure_ascii=False)}
                ready.append(event)
            return ready

        async for event in events:
            body = _chunk_body(event)
            if body is not None and body["choices"] and body["choices"][0].get("finish_reason") is not None:
                await score(listed_tokens(out, prep.params[0].stop_token_ids))
                for ready in release(float("inf")):
                    yield ready
                if scored[attached:]:
                    yield {"data": json.dumps({"id": prep.id, "object": "chat.completion.chunk",
                                               "created": prep.created, "model": prep.model_id, "choices": [
                                                   {"index": 0, "delta": {}, "logprobs": {"content": scored[attached:]},
                                                    "finish_reason": None}]}, ensure_ascii=False)}
                    attached = len(scored)
                yield event
                continue
            held.append((event, len(out.token_ids)))
            if len(out.token_ids) - len(scored) >= STREAM_BLOCK_TOKENS:
                await score(listed_tokens(out, prep.params[0].stop_token_ids))
            for ready in release(len(scored)):
                yield ready
        for ready in release(float("inf")):
            yield ready

    return stream_chat(engine, prep, admission, annotate)


def _chunk_body(event: dict[str, str]) -> dict[str, Any] | None:
    """The chat.completion.chunk an SSE event carries, or None (timing events, errors, [DONE])."""
    data = event.get("data", "")
    if not data.startswith("{"):
        return None
    body = json.loads(data)
    return body if body.get("object") == "chat.completion.chunk" else None
