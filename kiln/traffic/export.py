"""Served traffic as training data: request-log rows (kiln.traffic.request_log) -> `sft_chat` rows.

Each exported row is one served choice: the request's conversation plus the assistant message the
client received. The filters pick which requests count: a time range on `created`, the adapter that
served them, the request status (default: only successful ones) and the choice's finish reason
(default stop and tool_calls: a `length`-cut answer teaches the model to stop mid-sentence).
Rows the log kept without their bodies (over `max_capture_bytes`) cannot be exported and are counted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kiln.data.formats import sft_problem

DEFAULT_FINISH_REASONS = ("stop", "tool_calls")
_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


@dataclass
class ExportFilter:
    since: float | None = None          # unix seconds, inclusive
    until: float | None = None          # unix seconds, exclusive
    adapter: str | None = None          # the adapter label that served it ("base" for the base model)
    statuses: tuple[str, ...] = ("ok",)
    finish_reasons: tuple[str, ...] | None = DEFAULT_FINISH_REASONS   # None: any
    kinds: tuple[str, ...] = ("chat", "batch")


@dataclass
class ExportStats:
    requests: int = 0
    exported: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str, n: int = 1) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + n


def parse_when(text: str, *, now: float | None = None) -> float:
    """`2026-12-01`, `2026-12-01T14:30[:00][Z|+01:00]` (UTC when no zone), or a relative `90m`, `2h`, `7d`."""
    m = _RELATIVE.match(text)
    if m:
        base = datetime.now(UTC).timestamp() if now is None else now
        return base - float(m.group(1)) * _UNIT_SECS[m.group(2)]
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a time: use 2026-12-01, 2026-12-01T14:30, or 2h / 30m / 7d ago") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _conversations(row: dict[str, Any]) -> list[list[dict[str, Any]]] | None:
    if isinstance(row.get("messages"), list):
        return [row["messages"]]
    if isinstance(row.get("prompts"), list):
        return row["prompts"]
    return None


def sft_rows(rows: Iterable[dict[str, Any]], flt: ExportFilter, stats: ExportStats) -> Iterator[dict[str, Any]]:
    for row in rows:
        if flt.since is not None and row.get("created", 0) < flt.since:
            continue
        if flt.until is not None and row.get("created", 0) >= flt.until:
            continue
        if row.get("kind", "chat") not in flt.kinds:
            continue
        if flt.adapter is not None and row.get("adapter", "base") != flt.adapter:
            continue
        stats.requests += 1
        if row.get("status") not in flt.statuses:
            stats.skip(f"status {row.get('status')}")
            continue
        conversations = _conversations(row)
        if row.get("truncated") or conversations is None:
            stats.skip("stored without its messages (over max_capture_bytes)")
            continue
        for choice in row.get("choices") or []:
            reason = choice.get("finish_reason")
            if flt.finish_reasons is not None and reason not in flt.finish_reasons:
                stats.skip(f"finish_reason {reason}")
                continue
            index = choice.get("prompt_index") or 0
            if not 0 <= index < len(conversations):
                stats.skip("choice without its prompt")
                continue
            out = {"messages": [*conversations[index], choice["message"]]}
            if row.get("tools"):
                out["tools"] = row["tools"]
            if sft_problem(out) is not None:
                stats.skip("not a valid sft_chat row")
                continue
            stats.exported += 1
            yield out
