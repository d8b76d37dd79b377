"""Request-log rows -> sft_chat rows: filters by time, adapter, status and finish reason."""

from __future__ import annotations

import pytest

from kiln.data.formats import sft_problem
from kiln.traffic.export import ExportFilter, ExportStats, parse_when, sft_rows

Q = [{"role": "user", "content": "capital of France?"}]


def row(i: int, **kw) -> dict:
    base = {"id": f"chatcmpl-{i}", "kind": "chat", "created": 1000 + i, "adapter": "base", "status": "ok",
            "messages": Q, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                                        "finish_reason": "stop"}]}
    base.update(kw)
    return base


def export(rows, **kw):
    stats = ExportStats()
    return list(sft_rows(rows, ExportFilter(**kw), stats)), stats


def test_each_served_choice_becomes_one_sft_row():
    out, stats = export([row(1)])
    assert out == [{"messages": [*Q, {"role": "assistant", "content": "Paris"}]}]
    assert sft_problem(out[0]) is None and stats.exported == 1


def test_filters_by_time_adapter_and_status():
    rows = [row(1), row(2, adapter="fixes"), row(3, status="error"), row(4)]
    out, stats = export(rows, since=1002, adapter="base")
    assert len(out) == 1 and stats.requests == 2 and stats.skipped == {"status error": 1}
    out, _ = export(rows, until=1002)
    assert len(out) == 1


def test_length_cut_answers_are_left_out_unless_asked_for():
    cut = row(1, choices=[{"index": 0, "message": {"role": "assistant", "content": "Par"}, "finish_reason": "length"}])
    assert export([cut])[0] == []
    assert len(export([cut], finish_reasons=None)[0]) == 1


def test_batch_rows_pair_each_choice_with_its_prompt_and_bodiless_rows_are_counted():
    b = row(1, kind="batch", messages=None, prompts=[Q, [{"role": "user", "content": "2+2?"}]],
            choices=[{"index": 0, "prompt_index": 1, "message": {"role": "assistant", "content": "4"},
                      "finish_reason": "stop"}])
    b.pop("messages")
    out, _ = export([b, {"id": "x", "created": 1, "status": "ok", "truncated": True}])
    assert out[0]["messages"][0]["content"] == "2+2?"
    _, stats = export([{"id": "x", "created": 1, "status": "ok", "truncated": True}])
    assert stats.skipped == {"stored without its messages (over max_capture_bytes)": 1}


def test_times_read_as_dates_datetimes_or_relative_spans():
    assert parse_when("1970-01-02") == 86400
    assert parse_when("1970-01-01T01:00:00Z") == 3600
    assert parse_when("2h", now=10_000) == 10_000 - 7200
    with pytest.raises(ValueError, match="cannot read"):
        parse_when("yesterday-ish")
