"""The corrections store: append-only events, replayed on open, torn tails tolerated; states follow
the training jobs that took them."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.train.corrections import (
    PENDING,
    TRAINED,
    CorrectionStore,
    job_outcome,
    normalize_corrected,
    split_conversation,
)
from kiln.train.jobs import TrainJob

Q = [{"role": "user", "content": "What is the capital of Zorbania?"}]


def test_a_correction_is_pending_and_its_sft_row_ends_with_the_corrected_turn(tmp_path):
    store = CorrectionStore(tmp_path)
    c = store.add(Q, "Quillton.", request_id="chatcmpl-1", note="made-up country")
    assert c.state == PENDING and c.id.startswith("corr-")
    assert c.sft_row() == {"messages": [*Q, {"role": "assistant", "content": "Quillton."}]}
    assert [x.id for x in store.trainable()] == [c.id]


def test_a_trailing_assistant_turn_is_taken_as_the_original_answer(tmp_path):
    c = CorrectionStore(tmp_path).add([*Q, {"role": "assistant", "content": "Paris"}], {"content": "Quillton."})
    assert c.messages == Q and c.original == {"role": "assistant", "content": "Paris"}


def test_the_store_survives_a_reopen_and_a_torn_last_line(tmp_path):
    store = CorrectionStore(tmp_path)
    a = store.add(Q, "A")
    b = store.add(Q, "B")
    store.delete(a.id)
    with open(store.path, "ab") as f:
        f.write(b'{"op": "add", "correction": {"id": "corr-torn", "mes')
    again = CorrectionStore(tmp_path)
    assert [c.id for c in again.list()] == [b.id]
    c = again.add(Q, "C")   # appends after the torn line, on a fresh line
    assert [x.id for x in CorrectionStore(tmp_path).list()] == [c.id, b.id]


def test_training_marks_them_trained_only_for_the_job_that_took_them(tmp_path):
    store = CorrectionStore(tmp_path)
    c = store.add(Q, "Quillton.")
    store.submitted([c.id], "train-1")
    assert store.trainable() == [] and store.in_flight() == {"train-1": [c.id]}
    assert store.resolve("train-other", trained=True, adapter="x") == []
    assert store.resolve("train-1", trained=True, adapter="fixes-v1") == [c.id]
    reopened = CorrectionStore(tmp_path).get(c.id)
    assert reopened.state == TRAINED and reopened.trained_into == "fixes-v1" and reopened.training_job_id == "train-1"
    assert store.counts() == {"pending": 0, "trained": 1}


def test_a_failed_job_releases_its_corrections_back_to_pending(tmp_path):
    store = CorrectionStore(tmp_path)
    c = store.add(Q, "Quillton.")
    store.submitted([c.id], "train-1")
    store.resolve("train-1", trained=False, outcome="failed")
    again = CorrectionStore(tmp_path).get(c.id)
    assert again.state == PENDING and again.training_job_id is None
    assert again.history == [{"job_id": "train-1", "outcome": "failed", "at": again.history[0]["at"]}]
    assert [x.id for x in store.trainable()] == [c.id]


@pytest.mark.parametrize("bad, param", [
    ({"role": "user", "content": "x"}, "corrected.role"),
    ({"role": "assistant", "content": "  "}, "corrected.content"),
    (42, "corrected"),
])
def test_a_bad_corrected_message_is_a_400_naming_the_field(bad, param):
    with pytest.raises(KilnError) as e:
        normalize_corrected(bad)
    assert e.value.status == 400 and e.value.param == param


def test_a_conversation_needs_a_turn_before_the_answer():
    with pytest.raises(KilnError) as e:
        split_conversation([{"role": "assistant", "content": "hi"}])
    assert e.value.param == "messages"
    with pytest.raises(KilnError):
        split_conversation([])


def test_unknown_ids_are_404(tmp_path):
    store = CorrectionStore(tmp_path)
    for call in (store.get, store.delete):
        with pytest.raises(KilnError) as e:
            call("corr-nope")
        assert e.value.status == 404 and e.value.code == "correction_not_found"


def job(state: str, gate: str | None = None) -> TrainJob:
    j = TrainJob("train-1", "sft", "fixes", {}, {}, "2026-01-01T00:00:00Z", state=state)
    j.gate_outcome = gate
    return j


@pytest.mark.parametrize("state, gate, expected", [
    ("running", None, (False, False)),
    ("completed", None, (True, True)),
    ("completed", "pending", (False, False)),
    ("completed", "promoted", (True, True)),
    ("completed", "kept", (True, False)),
    ("failed", None, (True, False)),
    ("cancelled", None, (True, False)),
])
def test_a_job_trains_its_corrections_when_it_completes_and_its_adapter_may_serve(state, gate, expected):
    assert job_outcome(job(state, gate))[:2] == expected


def test_a_served_conversation_is_kept_whole_when_its_answer_is_known(tmp_path):
    prefilled = [*Q, {"role": "assistant", "content": "The capital is"}]
    c = CorrectionStore(tmp_path).add(prefilled, "Quillton.", original={"role": "assistant", "content": " Paris"})
    assert c.messages == prefilled and c.original == {"role": "assistant", "content": " Paris"}
