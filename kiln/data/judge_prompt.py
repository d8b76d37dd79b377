"""The pairwise judge prompt (semantics.md §11.2), shared by render_prompt, compile and validation.

Training rows, validation examples and live judging must see byte-identical prompts, so every
caller builds them here.
"""

from __future__ import annotations

from typing import Any

from kiln.core.messages import message_text

JUDGE_SYSTEM_PROMPT = (
    "You are an impartial judge. Compare two assistant replies to the same conversation and decide "
    "which one is better. Output `Winner: A`, `Winner: B`, or `Winner: Tie` on the first line, "
    "optionally followed by a line starting with `Reason:`."
)
JUDGE_INSTRUCTION = "Which reply is better? Answer with `Winner: A`, `Winner: B`, or `Winner: Tie`."
WINNER_REGEX = r"(?i)Winner:\s*(A|B|Tie)"
LABELS = {"a": "A", "b": "B", "tie": "Tie"}


def render_judge_prompt(prompt: list[dict[str, Any]], response_a: str, response_b: str) -> str:
    lines = ["Compare the following two assistant replies to this conversation:", "", "# Conversation"]
    lines += [f"[{m.get('role', '')}] {message_text(m.get('content'))}" for m in prompt]
    lines += ["", "# Reply A", response_a, "", "# Reply B", response_b, "", JUDGE_INSTRUCTION]
    return "\n".join(lines)


def judge_label(winner: str, note: str | None = None) -> str:
    """The assistant turn a judge is trained to produce: "Winner: A" plus an optional reason line."""
    text = f"Winner: {LABELS[winner]}"
    if note and note.strip():
        text += f"\nReason: {note.strip()}"
    return text


def judge_messages(prompt: list[dict[str, Any]], response_a: str, response_b: str) -> list[dict[str, str]]:
    """System + user messages that ask a judge to compare two replies."""
    return [
        {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
        {"role": "user", "content": render_judge_prompt(prompt, response_a, response_b)},
    ]
