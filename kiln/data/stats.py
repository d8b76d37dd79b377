"""DatasetStats: bounded structural statistics over the first rows of a dataset (semantics.md §9.2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.data.formats import RAW

STAT_SCAN_ROWS = 1000
SAMPLE_PATTERNS = 5


def role_pattern(messages: list[dict]) -> str:
    """Role sequence with consecutive repeats compressed: "user assistant tool×3 assistant"."""
    runs: list[list] = []
    for msg in messages:
        role = msg.get("role", "")
        if runs and runs[-1][0] == role:
            runs[-1][1] += 1
        else:
            runs.append([role, 1])
    return " ".join(role if n == 1 else f"{role}×{n}" for role, n in runs)


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # structured parts: count their text
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


@dataclass
class StatsAccumulator:
    """Feed rows in order with `add`; rows past the scan limit and non-conversations are ignored."""

    fmt: str
    scanned: int = 0
    total_messages: int = 0
    num_assistant_turns: int = 0
    num_tool_messages: int = 0
    num_with_tool_calls: int = 0
    max_messages_per_conv: int = 0
    max_content_chars: int = 0
    sample_role_patterns: list[str] = field(default_factory=list)

    def add(self, row: Any) -> None:
        if self.fmt == RAW or self.scanned >= STAT_SCAN_ROWS:
            return
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return
        self.scanned += 1
        self.total_messages += len(messages)
        self.max_messages_per_conv = max(self.max_messages_per_conv, len(messages))
        for msg in messages:
            role = msg.get("role")
            if role == "assistant":
                self.num_assistant_turns += 1
                calls = msg.get("tool_calls")
                if isinstance(calls, list) and calls:
                    self.num_with_tool_calls += 1
            elif role == "tool":
                self.num_tool_messages += 1
            self.max_content_chars = max(self.max_content_chars, _content_chars(msg.get("content")))
        if len(self.sample_role_patterns) < SAMPLE_PATTERNS:
            self.sample_role_patterns.append(role_pattern(messages))

    def to_json(self) -> dict[str, Any]:
        return {
            "num_assistant_turns": self.num_assistant_turns,
            "num_tool_messages": self.num_tool_messages,
            "num_with_tool_calls": self.num_with_tool_calls,
            "max_messages_per_conv": self.max_messages_per_conv,
            "max_content_chars": self.max_content_chars,
            "avg_messages_per_conv": self.total_messages / self.scanned if self.scanned else 0.0,
            "sample_role_patterns": list(self.sample_role_patterns),
        }


def compute_stats(fmt: str, rows: list[Any]) -> dict[str, Any]:
    acc = StatsAccumulator(fmt)
    for row in rows:
        acc.add(row)
    return acc.to_json()
