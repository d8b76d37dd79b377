"""The conversation a served completion answered, found by its response id: what corrections read
(`POST /v1/corrections` with `request_id`) from the recent-request ring, else the request log.

A reference that is wrong for the request it names (a `prompt_index` a chat request does not take, or
one out of a batch's range) is the caller's input error, worded by the caller (`invalid`); a request
that was never recorded is a 404, one too large to keep its messages a 409.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError
from kiln.traffic.records import CompletionRecorder


def served_conversation(recorder: CompletionRecorder, request_id: str, prompt_index: int | None, *,
                        invalid: Callable[..., KilnError]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str]:
    """(conversation, the answer served, the adapter that served it) of the request `request_id`."""
    logging_on = recorder.request_log is not None
    rec = recorder.find(request_id)
    if rec is None:
        where = "the recent-request ring" + (" or the request log" if logging_on else "")
        raise KilnError(404, "request_not_found", f"no served request {request_id!r} in {where}", param="request_id",
                        hint="Use the `id` of a chat completion (chatcmpl-...) as GET /v1/stats/recent-requests "
                             "shows it, or send `messages` instead."
                             + ("" if logging_on else " Enable [request_log] to find older requests."))
    if not rec.correctable:
        raise KilnError(409, "request_not_captured", f"request {request_id!r} was too large to keep its messages",
                        param="request_id", hint="Send the conversation as `messages` instead.")
    index = 0
    if rec.kind == "batch":
        count = len(rec.prompts or [])
        if prompt_index is None and count > 1:
            raise invalid(f"request {request_id!r} is a batch of {count} prompts; say which with `prompt_index`",
                          param="prompt_index")
        index = prompt_index or 0
        if index >= count:
            raise invalid(f"`prompt_index` {index} is out of range for a batch of {count} prompts",
                          param="prompt_index")
    elif prompt_index not in (None, 0):
        raise invalid("`prompt_index` applies to batch requests only", param="prompt_index")
    answer = rec.answer(index)
    return list(rec.conversation(index)), answer.message() if answer is not None else None, rec.adapter
