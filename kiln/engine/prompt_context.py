"""`PromptContext`: what request preparation (kiln.engine.chat_request) reads from the served model,
as plain values and callables, so preparation never reaches back into `Engine`: a chat request flows
prepare (with a context) -> `Engine.submit` -> assemble.

`Engine.prompt_context()` builds it once per engine; what changes while the engine lives (the adapter
store attached after load, the lazily built grammar compiler, the policy identity) is read through a
callable at the moment a request needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.core.sampling import SamplingParams
    from kiln.engine.grammar import GrammarCompiler
    from kiln.engine.lora_slots import AdapterTarget
    from kiln.engine.provenance import PolicyIdentity
    from kiln.engine.serving import ModelInfo


@dataclass(frozen=True)
class PromptContext:
    info: ModelInfo                                            # served id, context length, model defaults
    render_chat: Callable[..., str]                            # (messages, tools=, template_kwargs=) -> text
    encode_prompt: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    choice_params: Callable[[SamplingParams, int], list[SamplingParams]]   # seed + i per choice
    resolve_adapter: Callable[..., AdapterTarget | None]        # kiln.adapters resolution (400/404/409)
    adapter_store: Callable[[], Any]                           # the attached AdapterStore, or None
    grammars: Callable[[], GrammarCompiler]                    # output-grammar compiler (compile counters)
    policy: Callable[[], PolicyIdentity | None]                # rollout provenance identity
    tool_tag_ids: tuple[int, int] | None                       # `<tool_call>` / `</tool_call>` single ids
    close_think_ids: list[int]                                 # the tokenizer's encoding of `</think>`
    tool_format: str = "json"                                  # the template's tool-call form (tool_grammar)
