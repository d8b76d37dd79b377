"""Preference pairs: a prompt conversation, the reply preferred and the reply rejected. Pure: no model, no I/O.

Where pairs come from, all normalized to `PreferencePair`:
- a row `{messages, chosen, rejected}` (Kiln's inline `pairs`);
- TRL's preference rows `{prompt, chosen, rejected}`, conversational (`prompt` a message list, `chosen` /
  `rejected` a one-assistant-message list) or standard (strings: a string prompt is taken as one user
  message, since Kiln always trains through the model's chat template);
- OpenAI's DPO fine-tuning rows `{input: {messages}, preferred_output: [msg], non_preferred_output: [msg]}`;
- judgment sets (semantics.md §11): an A/B row's winner is chosen and the other reply rejected; tie and
  skip rows carry no preference and are left out (and counted).

A reply is one assistant turn; a pair whose replies are identical teaches nothing and is refused. Held-out
pairs are a share of the distinct prompts, every pair of a prompt on one side (a held-out prompt is never
trained on), chosen by the prompts' normalized hashes: the split depends only on the prompts, never on row
order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.core.messages import message_text
from kiln.data.formats import messages_problem
from kiln.data.identity import normalized_sha256
from kiln.data.judgment_rows import JudgmentRow

EXPORT_FORMATS = ("trl", "openai")


@dataclass(frozen=True)
class PreferencePair:
    messages: list[dict[str, Any]]     # the prompt conversation
    chosen: str
    rejected: str

    def as_sft_row(self) -> dict[str, Any]:
        """The preferred conversation: what the post_eval overlap check reads as a training row."""
        return {"messages": [*self.messages, {"role": "assistant", "content": self.chosen}]}

    def to_trl(self) -> dict[str, Any]:
        """TRL's conversational preference row (explicit prompt)."""
        return {"prompt": self.messages, "chosen": [{"role": "assistant", "content": self.chosen}],
                "rejected": [{"role": "assistant", "content": self.rejected}]}

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's DPO fine-tuning row."""
        return {"input": {"messages": self.messages, "tools": [], "parallel_tool_calls": True},
                "preferred_output": [{"role": "assistant", "content": self.chosen}],
                "non_preferred_output": [{"role": "assistant", "content": self.rejected}]}


@dataclass
class JudgmentPairs:
    pairs: list[PreferencePair] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    ties: int = 0
    skips: int = 0


def _reply(value: Any, key: str) -> tuple[str | None, str | None]:
    """(text, problem) of one reply: a string, an assistant message, or a list of exactly one."""
    if isinstance(value, list):
        if len(value) != 1:
            return None, f"`{key}` must be one assistant message (got a list of {len(value)})"
        value = value[0]
    if isinstance(value, dict):
        if value.get("role") != "assistant":
            return None, f"`{key}` must be an assistant message"
        content = value.get("content")
        if not isinstance(content, str | list):
            return None, f"`{key}`.content must be a string or an array of parts"
        value = message_text(content)
    if not isinstance(value, str):
        return None, f"`{key}` must be a string or an assistant message"
    if not value.strip():
        return None, f"`{key}` is empty"
    return value, None


def _prompt(row: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    if isinstance(row.get("input"), dict):
        prompt: Any = row["input"].get("messages")
    else:
        prompt = row.get("messages", row.get("prompt"))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    problem = messages_problem(prompt)
    if problem:
        return None, problem.replace("`messages`", "the prompt (`messages` or `prompt`)")
    return [dict(m) for m in prompt], None


def pair_from_row(row: Any) -> tuple[PreferencePair | None, str | None]:
    """(pair, None) or (None, problem) for one row in any of the accepted shapes."""
    if not isinstance(row, dict):
        return None, "expected a JSON object with a prompt (`messages` or `prompt`), `chosen` and `rejected`"
    messages, problem = _prompt(row)
    if problem:
        return None, problem
    chosen_key, rejected_key = ("preferred_output", "non_preferred_output") if "preferred_output" in row \
        else ("chosen", "rejected")
    chosen, problem = _reply(row.get(chosen_key), chosen_key)
    if problem:
        return None, problem
    rejected, problem = _reply(row.get(rejected_key), rejected_key)
    if problem:
        return None, problem
    if chosen == rejected:
        return None, f"`{chosen_key}` and `{rejected_key}` are identical, so there is no preference to learn"
    assert messages is not None and chosen is not None and rejected is not None
    return PreferencePair(messages, chosen, rejected), None


def pairs_from_judgments(name: str, rows: Sequence[JudgmentRow]) -> JudgmentPairs:
    """A/B rows as pairs (rows whose two replies are equal are counted with the ties); ties and skips counted."""
    out = JudgmentPairs()
    for row in rows:
        if row.winner == "skip":
            out.skips += 1
            continue
        if row.winner == "tie" or row.response_a == row.response_b:
            out.ties += 1
            continue
        chosen, rejected = (row.response_a, row.response_b) if row.winner == "a" else (row.response_b, row.response_a)
        out.pairs.append(PreferencePair([dict(m) for m in row.prompt], chosen, rejected))
        out.labels.append(f"judgments {name!r} row {row.id!r}")
    return out


def heldout_mask(pairs: Sequence[PreferencePair], percent: int) -> list[bool]:
    """Which pairs are held out: round(percent% of the distinct prompts), at least one when there are two
    or more prompts and percent > 0, never every one; every pair of a prompt on one side. The prompts
    held out are those whose normalized hash sorts first, so the choice depends on the prompts alone."""
    keys = [normalized_sha256({"messages": pair.messages}) for pair in pairs]
    prompts = sorted(set(keys))
    if percent <= 0 or len(prompts) < 2:
        return [False] * len(pairs)
    n = min(max(1, round(len(prompts) * percent / 100)), len(prompts) - 1)
    held = set(prompts[:n])
    return [key in held for key in keys]


def export_rows(pairs: Sequence[PreferencePair], fmt: str) -> list[dict[str, Any]]:
    return [p.to_trl() if fmt == "trl" else p.to_openai() for p in pairs]
