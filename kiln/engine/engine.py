"""The batching actor (one thread owns the model) and its asyncio bridge.

HTTP handlers never touch the model: they submit a request to the actor's inbox and read token
events from an asyncio queue the actor fills with `loop.call_soon_threadsafe`. Between steps the
actor drains its inbox, so new requests join a running batch at the next step and aborted ones
(a client that went away) free their blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kiln.core.block_manager import BlockManager
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.sampling import SamplingParams
from kiln.core.scheduler import Scheduler
from kiln.core.sequence import Sequence
from kiln.core.stop import StopMatcher
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.runner import ModelRunner
from kiln.engine.tokenizer import Tokenizer

log = logging.getLogger("kiln.engine")


@dataclass
class ChoiceEvent:
    """New output of one choice: text safe to show, the tokens behind it, and the finish reason once done."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    # perf_counter() when each token in token_ids was sampled
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    # True where the thinking-budget controller forced the token (its logprob is then None)
    forced: list[bool] = field(default_factory=list)
    # choices[].thinking_budget outcome, on the finishing event when a controller ran
    budget_outcome: dict | None = None


@dataclass
class _Choice:
    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    stop: StopMatcher
    emit: Callable[[ChoiceEvent], None]
    request_id: str
    budget: ThinkingBudgetController | None = None


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    emit: Callable[[ChoiceEvent], None]
    budgets: list[ThinkingBudgetController | None] | None = None


@dataclass
class _Abort:
    request_id: str


class LLMEngine:
    """The actor thread: schedule a step, run it, turn sampled tokens into choice events."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, block_size: int, num_blocks: int,
                 max_num_seqs: int, max_batch_tokens: int, enable_prefix_caching: bool = True) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_batch_tokens)
        self._inbox: queue.Queue = queue.Queue()
        self._choices: dict[int, _Choice] = {}
        self._by_request: dict[str, list[_Choice]] = {}
        self._seq_ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.steps = 0
        self.last_step_at = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- called from other threads ---------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: list[SamplingParams],
               emit: Callable[[ChoiceEvent], None],
               budgets: list[ThinkingBudgetController | None] | None = None) -> None:
        self._inbox.put(_Submit(request_id, prompt_ids, params, emit, budgets))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # -- the actor -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not self.scheduler.has_work())
                if self._stop.is_set():
                    break
                if self.scheduler.has_work():
                    self._step()
            except Exception:  # the actor must survive anything one batch does
                log.exception("engine step failed")
                self._fail_all("engine step failed; see the server log")
        self._fail_all("server shutting down")

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, _Submit):
                self._admit(msg)
            elif isinstance(msg, _Abort):
                self._abort(msg.request_id)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, msg: _Submit) -> None:
        first: Sequence | None = None
        choices: list[_Choice] = []
        for index, params in enumerate(msg.params):
            seq = Sequence(next(self._seq_ids), list(msg.prompt_ids), params)
            seq.wait_for = first  # later choices reuse the first choice's prompt blocks
            first = first or seq
            choice = _Choice(seq, index, IncrementalDetokenizer(self.tokenizer, msg.prompt_ids),
                             StopMatcher(params.stop), msg.emit, msg.request_id,
                             msg.budgets[index] if msg.budgets else None)
            choices.append(choice)
            if params.max_tokens <= 0:
                msg.emit(ChoiceEvent(index, "", [], [], finish_reason="length"))
                continue
            self._choices[seq.seq_id] = choice
            self.scheduler.add(seq)
        self._by_request[msg.request_id] = choices

    def _abort(self, request_id: str) -> None:
        for choice in self._by_request.pop(request_id, []):
            if self._choices.pop(choice.seq.seq_id, None) is not None:
                self.scheduler.abort(choice.seq.seq_id)
                self.runner.release(choice.seq.seq_id)

    def _step(self) -> None:
        out = self.scheduler.schedule()
        if not out.items:
            time.sleep(0.001)  # waiting work that cannot be admitted yet
            return
        results = self.runner.step(out)
        for seq_id, res in results.items():
            choice = self._choices.get(seq_id)
            if choice is not None and choice.budget is not None:
                decided = choice.budget.step(choice.seq.output_token_ids, res.token_id)
                if decided.forced:
                    res.token_id, res.logprob, res.forced = decided.token_id, None, True
        self.scheduler.on_step_done(out, {sid: r.token_id for sid, r in results.items()})
        now = time.perf_counter()
        self.steps += 1
        self.last_step_at = time.monotonic()
        for seq_id, res in results.items():
            choice = self._choices.get(seq_id)
            if choice is not None:
                self._on_token(choice, res.token_id, res.logprob, now, res.forced)

    def _on_token(self, choice: _Choice, token: int, logprob: float | None, now: float,
                  forced: bool = False) -> None:
        seq, params = choice.seq, choice.seq.params
        finish: str | None = None
        text = ""
        if not params.ignore_eos and token in params.stop_token_ids:
            finish = "stop"
            text = choice.stop.feed(choice.detok.flush())[0] + choice.stop.flush()
        else:
            text, stopped = choice.stop.feed(choice.detok.step(token))
            if stopped:
                finish = "stop"
            elif seq.num_output_tokens >= params.max_tokens:
                tail, stopped = choice.stop.feed(choice.detok.flush())
                text += tail if stopped else tail + choice.stop.flush()
                finish = "stop" if stopped else "length"
        outcome = None
        if finish is not None:
            self._finish(choice, finish)
            if choice.budget is not None:
                outcome = choice.budget.outcome(seq.num_output_tokens)
        choice.emit(ChoiceEvent(choice.index, text, [token], [logprob], finish, [now], forced=[forced],
                                budget_outcome=outcome))

    def _finish(self, choice: _Choice, reason: str) -> None:
        self._choices.pop(choice.seq.seq_id, None)
        self.scheduler.finish(choice.seq, reason)
        self.runner.release(choice.seq.seq_id)
        siblings = self._by_request.get(choice.request_id, [])
        if all(c.seq.seq_id not in self._choices for c in siblings):
            self._by_request.pop(choice.request_id, None)

    def _fail_all(self, message: str) -> None:
        for choice in list(self._choices.values()):
            self._finish(choice, "error")
            choice.emit(ChoiceEvent(choice.index, "", [], [], "error", error=message))


class AsyncEngine:
    """The asyncio face of the actor: `async for event in engine.generate(...)`."""

    def __init__(self, actor: LLMEngine) -> None:
        self.actor = actor
        self._ids = itertools.count(1)

    async def generate(self, prompt_ids: list[int], params: list[SamplingParams],
                       request_id: str | None = None,
                       budgets: list[ThinkingBudgetController | None] | None = None,
                       ) -> AsyncIterator[ChoiceEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        rid = request_id or f"req-{next(self._ids)}"
        pending = set(range(len(params)))

        def emit(ev: ChoiceEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        self.actor.submit(rid, prompt_ids, params, emit, budgets)
        try:
            while pending:
                ev = await events.get()
                if ev.finish_reason is not None:
                    pending.discard(ev.index)
                yield ev
        finally:
            if pending:  # the consumer went away (client disconnect): free the blocks now
                self.actor.abort(rid)
