"""Eval-side reasoning split (semantics.md §3.7): scorers see the answer, metrics see the reasoning.

Unlike the chat splitter, this one looks for a literal `<think>` in the stored completion text, so
the generator first normalizes completions whose prompt already opened the thinking block.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass(frozen=True)
class ThinkingSplit:
    had_thinking: bool
    unclosed: bool
    # None when there was no thinking block; "" for an empty one.
    reasoning: str | None
    answer: str


def split_thinking(text: str) -> ThinkingSplit:
    start = text.find(OPEN_TAG)
    if start < 0 or text[:start].strip():
        # Text before a late `<think>` means the model answered first: all of it is answer.
        return ThinkingSplit(had_thinking=False, unclosed=False, reasoning=None, answer=text.lstrip())
    body = text[start + len(OPEN_TAG):]
    end = body.find(CLOSE_TAG)
    if end < 0:
        return ThinkingSplit(had_thinking=True, unclosed=True, reasoning=body.strip("\n"), answer="")
    return ThinkingSplit(
        had_thinking=True,
        unclosed=False,
        reasoning=body[:end].strip("\n"),
        answer=body[end + len(CLOSE_TAG):].lstrip("\n"),
    )


def normalize_completion(raw_text: str, prompt_starts_in_reasoning: bool) -> str:
    """The stored `completion_text`: re-attach the `<think>` the prompt template already emitted."""
    if prompt_starts_in_reasoning and not raw_text.lstrip().startswith(OPEN_TAG):
        return OPEN_TAG + "\n" + raw_text
    return raw_text
