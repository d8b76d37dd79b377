"""Completion records: the recent-request ring (newest first, bounded), its wire rows (previews,
recentRecord budgets), the request-log row and its way back, and a recorder that never fails a request."""

from __future__ import annotations

import pytest

from kiln.testing.schemas import validate
from kiln.traffic.records import (
    ChoiceRecord,
    CompletionRecord,
    CompletionRecorder,
    RecentRequests,
    preview,
    record_from_log_row,
    rehearsal_rows,
)

TB = "thinking-budget-v1.schema.json"
UNLIMITED = {"configured": False, "tokens_source": "unlimited", "time_source": "unlimited"}


def rec(i: int, **kw) -> CompletionRecord:
    base = dict(id=f"chatcmpl-{i}", request_id=f"req-{i}", kind="chat", model="tiny",
                messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}],
                choices=[ChoiceRecord(0, f"answer {i}", "stop", 3)], prompt_tokens=10, completion_tokens=3,
                thinking_budget={**UNLIMITED, "applied": False})
    base.update(kw)
    return CompletionRecord(**base)


def test_the_ring_lists_newest_first_and_forgets_the_oldest():
    ring = RecentRequests(capacity=3)
    for i in range(5):
        ring.add(rec(i))
    assert [r.id for r in ring.list()] == ["chatcmpl-4", "chatcmpl-3", "chatcmpl-2"]
    assert [r.id for r in ring.list(limit=1)] == ["chatcmpl-4"]
    assert ring.find("chatcmpl-0") is None and ring.find("chatcmpl-3").id == "chatcmpl-3"


def test_the_ring_finds_a_record_by_the_clients_request_id_too():
    ring = RecentRequests()
    ring.add(rec(1, request_id="client-abc"))
    assert ring.find("client-abc").id == "chatcmpl-1"


def test_a_recent_row_previews_the_last_user_turn_and_the_answer():
    row = rec(1, choices=[ChoiceRecord(0, "x" * 500, "length", 3)]).recent(preview_chars=20)
    assert row["prompt_preview"] == "question 1"
    assert row["completion_preview"] == "x" * 20 + "…"
    assert row["finish_reason"] == "stop" and row["status"] == "ok" and row["correctable"] is True
    validate(TB, "recentRecord", row["thinking_budget"])


def test_a_failed_request_before_the_budget_applied_has_no_applied_field():
    failed = rec(2, status="rejected", finish_reason="error", choices=[], completion_tokens=0,
                 error="max_tokens 1 cannot fit the close sequence",
                 thinking_budget={"configured": True, "max_tokens": 8, "tokens_source": "request",
                                  "time_source": "unlimited"})
    row = failed.recent()
    assert "applied" not in row["thinking_budget"] and row["completion_preview"] == ""
    validate(TB, "recentRecord", row["thinking_budget"])
    assert row["error"].startswith("max_tokens")


def test_content_parts_are_previewed_as_text():
    r = rec(3, messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                        {"type": "text", "text": "there"}]}])
    assert r.recent()["prompt_preview"] == "hello there"


def test_preview_never_splits_a_code_point():
    assert preview("héllo wörld", 3) == "hél…"
    assert preview("short", 10) == "short" and preview("abc", 0) == ""


def test_a_huge_conversation_keeps_its_preview_but_not_its_messages():
    ring = RecentRequests(capture_chars=100)
    ring.add(rec(1, messages=[{"role": "user", "content": "y" * 1000}]))
    (held,) = ring.list()
    assert held.messages is None and not held.correctable
    assert held.recent()["prompt_preview"] == ""


def test_a_log_row_carries_everything_and_reads_back():
    r = rec(4, adapter="fixes", adapters=[{"name": "fixes", "scale": 1.0, "revision": "sha256:ab"}],
            sampling={"temperature": 0.0}, streamed=True,
            choices=[ChoiceRecord(0, "4", "stop", 1, reasoning="2+2", tool_calls=None)])
    row = r.log_row()
    assert row["messages"][-1] == {"role": "user", "content": "question 4"}
    assert row["choices"][0]["message"] == {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    assert row["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    back = record_from_log_row(row)
    assert back.messages == r.messages and back.answer().content == "4" and back.adapters == r.adapters


def test_batch_records_answer_per_prompt():
    b = rec(5, id="batchcmpl-5", kind="batch", messages=None,
            prompts=[[{"role": "user", "content": "p0"}], [{"role": "user", "content": "p1"}]],
            choices=[ChoiceRecord(0, "a0", "stop", 1, prompt_index=0), ChoiceRecord(0, "a1", "stop", 1, prompt_index=1)])
    assert b.conversation(1) == [{"role": "user", "content": "p1"}] and b.answer(1).content == "a1"
    row = b.recent()
    assert row["num_prompts"] == 2 and row["num_choices"] == 2 and row["prompt_preview"] == "p0"


class _Log:
    def __init__(self):
        self.rows = []

    def write(self, row):
        self.rows.append(row)
        return True

    def find(self, row_id):
        return next((r for r in self.rows if r["id"] == row_id), None)

    def close(self):
        self.closed = True


def test_the_recorder_fans_out_and_survives_a_failing_listener():
    seen = []
    rlog = _Log()

    def boom(_):
        raise RuntimeError("listener bug")

    recorder = CompletionRecorder(RecentRequests(capacity=1), rlog, listeners=[boom, seen.append])
    recorder.finished(rec(1))
    recorder.finished(rec(2))
    assert [r.id for r in seen] == ["chatcmpl-1", "chatcmpl-2"]
    assert [r["id"] for r in rlog.rows] == ["chatcmpl-1", "chatcmpl-2"]
    # chatcmpl-1 left the ring (capacity 1): found in the log
    assert recorder.find("chatcmpl-1").messages[-1]["content"] == "question 1"
    recorder.close()
    assert rlog.closed
    assert CompletionRecorder(RecentRequests()).flush() is True   # no log: nothing to wait for


def test_a_recorder_whose_log_raises_still_keeps_the_ring():
    class Broken(_Log):
        def write(self, row):
            raise OSError("disk gone")

    recorder = CompletionRecorder(RecentRequests(), Broken())
    recorder.finished(rec(1))
    assert recorder.ring.find("chatcmpl-1") is not None


@pytest.mark.parametrize("capacity", [0, -5])
def test_the_ring_holds_at_least_one(capacity):
    assert RecentRequests(capacity).capacity == 1


def test_rehearsal_takes_uncorrected_finished_answers_once_per_prompt_newest_first():
    records = [
        rec(9, messages=[{"role": "user", "content": "Capital of France?"}],
            choices=[ChoiceRecord(0, "Paris.", "stop", 2)]),
        rec(8, messages=[{"role": "user", "content": "capital of  FRANCE?"}],
            choices=[ChoiceRecord(0, "Lyon.", "stop", 2)]),                        # same prompt, older
        rec(7, choices=[ChoiceRecord(0, "cut", "length", 2)]),                     # did not finish
        rec(6, status="error", finish_reason="error", choices=[]),
        rec(5, messages=[{"role": "user", "content": "Capital of Zorbania?"}]),   # the corrected prompt
        rec(4),                                                                   # the corrected request
        rec(3, choices=[ChoiceRecord(0, "Three.", "stop", 1)]),
        rec(2, choices=[ChoiceRecord(0, "Two.", "stop", 1)]),
    ]
    rows = rehearsal_rows(records, 2, exclude_ids=["chatcmpl-4"], exclude_prompts=["capital of zorbania?"])
    assert rows == [
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]},
        {"messages": [*records[6].messages, {"role": "assistant", "content": "Three."}]},
    ]
    assert rehearsal_rows(records, 0) == []
