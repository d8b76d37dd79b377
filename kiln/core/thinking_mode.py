"""Thinking on/off: read from the rendered prompt, and who chose it (semantics.md §3.1, §2.3).

Whether generation starts inside a reasoning block is a fact about the rendered prompt, not about the
request: a template may ignore `enable_thinking`, and a budget never turns thinking on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kiln.core.thinking_budget import CLOSE_TEXT, OPEN_TEXT

# Headers that open the assistant turn in common chat templates; the generation prompt follows the last one.
ASSISTANT_HEADERS = (
    "<|im_start|>assistant",
    "<|start_header_id|>assistant<|end_header_id|>",
    "<|assistant|>",
    "<｜Assistant｜>",
)

ThinkingSource = Literal["custom", "request", "server_default", "template_default"]
RecentThinkingMode = Literal["explicit_enabled", "explicit_disabled", "custom", "template_default"]


@dataclass(frozen=True)
class ThinkingDetection:
    thinking_enabled: bool
    # Text the prompt already placed inside the open reasoning block (usually "\n"); "" when not thinking.
    prefill: str = ""

    @property
    def thinking_mode(self) -> Literal["reasoning", "non_reasoning"]:
        return "reasoning" if self.thinking_enabled else "non_reasoning"


def _generation_tail(rendered_prompt: str) -> str:
    cut = max(
        (rendered_prompt.rfind(h) + len(h) for h in ASSISTANT_HEADERS if h in rendered_prompt), default=0
    )
    return rendered_prompt[cut:]


def detect_thinking_mode(rendered_prompt: str) -> ThinkingDetection:
    """Generation starts in reasoning when the tail after the last assistant header has an unclosed `<think>`.

    This covers §2.3's rule (the right-trimmed prompt ends with `<think>`) and also an assistant prefill
    that continues inside the block. With no known header, the whole prompt is the tail.
    """
    tail = _generation_tail(rendered_prompt)
    opened = tail.rfind(OPEN_TEXT)
    if opened < 0:
        return ThinkingDetection(False)
    after = tail[opened + len(OPEN_TEXT) :]
    if CLOSE_TEXT in after:
        return ThinkingDetection(False)
    return ThinkingDetection(True, after)


def effective_template_kwargs(
    request_kwargs: Mapping[str, Any] | None,
    *,
    default_thinking_enabled: bool | None = None,
    eval_mode_thinking_default: bool | None = None,
) -> dict[str, Any]:
    """Request kwargs, plus `enable_thinking` from the server default when the request has none.

    In eval mode the model profile's eval default fills it when the server default is unset.
    """
    kwargs = dict(request_kwargs or {})
    if "enable_thinking" not in kwargs:
        if default_thinking_enabled is not None:
            kwargs["enable_thinking"] = default_thinking_enabled
        elif eval_mode_thinking_default is not None:
            kwargs["enable_thinking"] = eval_mode_thinking_default
    return kwargs


def thinking_source(
    request_kwargs: Mapping[str, Any] | None, *, default_thinking_enabled: bool | None = None
) -> ThinkingSource:
    """`metadata.thinking_source`, from the request's own kwargs (before the server default is merged)."""
    kwargs = request_kwargs or {}
    if "enable_thinking" in kwargs:
        return "request" if isinstance(kwargs["enable_thinking"], bool) else "custom"
    return "server_default" if default_thinking_enabled is not None else "template_default"


def recent_thinking_mode(effective_kwargs: Mapping[str, Any] | None) -> RecentThinkingMode:
    """Recent-requests `thinking_mode`, from the kwargs the template actually received."""
    kwargs = effective_kwargs or {}
    if "enable_thinking" not in kwargs:
        return "template_default"
    value = kwargs["enable_thinking"]
    if value is True:
        return "explicit_enabled"
    if value is False:
        return "explicit_disabled"
    return "custom"
