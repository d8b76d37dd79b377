"""Reading a remote teacher's prompt_logprobs answer (top-K by rank, the observed token outside it left out)
and its retry rule (no answer, 408/429/5xx retried; other refusals final), without a model."""

from __future__ import annotations

import httpx
import pytest

from kiln.errors import KilnError
from kiln.train.remote_teacher import RemoteTeacher


def answer(entries) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"index": 0, "prompt_logprobs": entries}]})


def teacher(handler) -> tuple[RemoteTeacher, list[dict]]:
    seen: list[dict] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, "body": request.read()})
        return handler(len(seen))

    return RemoteTeacher("far", "http://127.0.0.1:9", "m", transport=httpx.MockTransport(record),
                         sleep=lambda s: None), seen


ENTRIES = [None,
           {"5": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -2.5, "rank": 2}, "9": {"logprob": -4.0, "rank": 40}},
           {"3": {"logprob": -1.0, "rank": 2}, "4": {"logprob": -0.5, "rank": 1}}]


def test_the_top_k_at_each_scored_position_is_read_by_rank_leaving_the_observed_token_outside_it_out():
    remote, seen = teacher(lambda n: answer(ENTRIES))
    ids, logp = remote.top_k([1, 9, 3], 1, 2, vocab_size=10)
    assert ids.tolist() == [[5, 7], [4, 3]] and logp.flatten().tolist() == pytest.approx([-0.1, -2.5, -0.5, -1.0])
    assert seen[0]["path"] == "/v1/completions" and b'"prompt_logprobs":2' in seen[0]["body"].replace(b" ", b"")


def test_unavailable_answers_are_retried_until_one_succeeds():
    remote, seen = teacher(lambda n: answer(ENTRIES) if n == 3 else httpx.Response(503, json={"error": "busy"}))
    assert remote.top_k([1, 9, 3], 2, 2, vocab_size=10)[0].tolist() == [[4, 3]] and len(seen) == 3


def test_a_teacher_that_keeps_failing_is_an_error_naming_it_after_the_attempts():
    remote, seen = teacher(lambda n: httpx.Response(502, text="bad gateway"))
    with pytest.raises(KilnError) as e:
        remote.top_k([1, 9, 3], 1, 2, vocab_size=10)
    assert len(seen) == 3 and "'far'" in e.value.message and "after 3 attempts" in e.value.message


def test_a_refusal_is_final_and_says_what_the_teacher_said():
    remote, seen = teacher(lambda n: httpx.Response(400, json={"error": {"message": "adapter 'x' is active"}}))
    with pytest.raises(KilnError) as e:
        remote.top_k([1, 9, 3], 1, 2, vocab_size=10)
    assert len(seen) == 1 and "adapter 'x' is active" in e.value.message


def test_ids_outside_the_students_vocabulary_are_refused():
    remote, _ = teacher(lambda n: answer(ENTRIES))
    with pytest.raises(KilnError) as e:
        remote.top_k([1, 9, 3], 1, 2, vocab_size=6)
    assert "vocabulary" in e.value.message
