"""Bounded admission: limits on waiting requests and queued prompt tokens."""

from __future__ import annotations

from kiln.core.admission import AdmissionGate, default_token_limit


def test_requests_past_the_waiting_limit_are_refused_and_take_nothing():
    gate = AdmissionGate(max_waiting_requests=2)
    assert len(gate.admit([10])) == 1 and len(gate.admit([10])) == 1
    assert gate.admit([10]) == "requests"
    assert (gate.waiting, gate.queued_tokens, gate.refused_total) == (2, 20, 1)


def test_a_started_request_frees_its_place_and_its_tokens():
    gate = AdmissionGate(max_waiting_requests=1)
    (ticket,) = gate.admit([7])
    gate.started(ticket)
    gate.started(ticket)   # idempotent
    assert (gate.waiting, gate.queued_tokens) == (0, 0)
    assert len(gate.admit([7])) == 1


def test_queued_prompt_tokens_have_their_own_limit():
    gate = AdmissionGate(max_waiting_requests=100, max_queued_tokens=50)
    gate.admit([30])
    assert gate.admit([30]) == "tokens" and gate.refused_by == {"requests": 0, "tokens": 1}
    assert len(gate.admit([20])) == 1


def test_with_nothing_waiting_even_an_oversized_request_is_admitted():
    gate = AdmissionGate(max_waiting_requests=2, max_queued_tokens=10)
    assert len(gate.admit([500, 500, 500])) == 3
    assert gate.admit([1]) == "requests"


def test_the_default_token_limit_is_sized_from_the_kv_pool():
    assert default_token_limit(kv_pool_tokens=4096, max_model_len=2048) == 16384
    assert default_token_limit(kv_pool_tokens=256, max_model_len=8192) == 8192
