"""Bounded admission: how much work may wait for the engine before new work is refused.

A request waits from the moment it is admitted until its first event comes back (prefill done, or its
score computed); while waiting it holds its prompt tokens against the token limit, once however many
choices it asks for (the other choices wait for the first to compute the prompt and share it through
the prefix cache, kiln/core/scheduler.py).
Past either limit a new request is refused before anything is queued -- the caller answers 429 with
Retry-After -- but a request is always admitted when nothing waits, so one larger than a limit still
runs alone rather than never. Everything admitted runs to completion: the gate only says no up front.

Pure bookkeeping, no threads: the asyncio facade calls it from the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_WAITING = 1024      # the cap whatever the model; a smaller setting wins
AUTO = 0


@dataclass
class Ticket:
    """One admitted unit of work (a chat request, a batch's prompt, a scoring call)."""

    tokens: int
    waiting: bool = True


@dataclass
class AdmissionGate:
    max_waiting_requests: int = DEFAULT_MAX_WAITING
    max_queued_tokens: int = 0          # 0: no token limit
    waiting: int = 0
    queued_tokens: int = 0
    peak_waiting: int = 0
    admitted_total: int = 0
    refused_total: int = 0
    refused_by: dict[str, int] = field(default_factory=lambda: {"requests": 0, "tokens": 0})

    def check(self, token_counts: list[int]) -> str | None:
        """Why `len(token_counts)` new units cannot be admitted now ("requests" | "tokens"), or None."""
        if self.waiting == 0:
            return None
        if self.waiting + len(token_counts) > self.max_waiting_requests:
            return "requests"
        if self.max_queued_tokens > 0 and self.queued_tokens + sum(token_counts) > self.max_queued_tokens:
            return "tokens"
        return None

    def admit(self, token_counts: list[int]) -> list[Ticket] | str:
        """Tickets for the new units, or the name of the limit that refused them (nothing is taken then)."""
        reason = self.check(token_counts)
        if reason is not None:
            self.refused_total += 1
            self.refused_by[reason] += 1
            return reason
        self.waiting += len(token_counts)
        self.queued_tokens += sum(token_counts)
        self.peak_waiting = max(self.peak_waiting, self.waiting)
        self.admitted_total += len(token_counts)
        return [Ticket(t) for t in token_counts]

    def started(self, ticket: Ticket) -> None:
        """The unit's first event arrived: it no longer waits (idempotent)."""
        if ticket.waiting:
            ticket.waiting = False
            self.waiting -= 1
            self.queued_tokens -= ticket.tokens

    done = started   # a unit that finishes (or fails) without a first event stops waiting too


def default_token_limit(kv_pool_tokens: int, max_model_len: int) -> int:
    """Sized from the KV pool: queued prompts may fill it four times over (at least one longest prompt),
    so the engine never idles for want of work and a burst never queues more than a few pools' worth."""
    return max(4 * kv_pool_tokens, max_model_len)


def default_waiting_limit(max_num_seqs: int) -> int:
    """Sixteen batches' worth of waiting requests, never more than DEFAULT_MAX_WAITING."""
    return min(DEFAULT_MAX_WAITING, 16 * max_num_seqs)


def gate_for(max_waiting_requests: int, max_queued_prompt_tokens: int, *, max_num_seqs: int, kv_pool_tokens: int,
             max_model_len: int) -> AdmissionGate:
    """The gate from settings (0 = the default sized from the engine)."""
    waiting = max_waiting_requests or default_waiting_limit(max_num_seqs)
    tokens = max_queued_prompt_tokens or default_token_limit(kv_pool_tokens, max_model_len)
    return AdmissionGate(waiting, tokens)
