"""The batching actor (`EngineActor`: one thread owns the model) and its asyncio bridge (`ActorBridge`).

HTTP handlers never touch the model: they submit a request to the actor's inbox and read token
events from an asyncio queue the actor fills with `loop.call_soon_threadsafe`, a step's events in one
batch, handed over when the next step's model call starts (kiln.engine.outbox). Between steps the
actor drains its inbox, so new requests join a running batch at the next step and aborted ones
(a client that went away) free their blocks at once. Prompt scoring (/v1/completions) also runs on
the actor, between steps, since only the actor may touch the model.

A choice under an output grammar (kiln.engine.grammar) advances its matcher with every token it keeps;
the matcher failing fails that choice alone (finish_reason "error"), and a completed grammar ends the
choice with "stop" at once (nothing but EOS could follow).

The actor times every request (kiln.engine.timing): inbox wait, admission, the steps that carried
its prompt and its decodes, pacing sleeps, and per token when it was ready and handed off.
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
from kiln.core.decode_stats import DecodeWindow
from kiln.core.prefill_pacer import ItlPacing
from kiln.core.sampling import SamplingParams
from kiln.core.scheduler import Scheduler
from kiln.core.sequence import Sequence
from kiln.core.stop import StopMatcher
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.grammar import CompiledGrammar
from kiln.engine.lora_slots import AdapterTarget, LoraSlots
from kiln.engine.outbox import Outbox, sink_emit
from kiln.engine.runner import ModelRunner
from kiln.engine.scoring import PromptScores
from kiln.engine.timing import ChoiceStats, StepTiming
from kiln.engine.tokenizer import Tokenizer
from kiln.model.heap import trim_heap

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
    # perf_counter() when the actor handed the event to the handler's loop / the handler dequeued it
    delivered_at: float | None = None
    received_at: float | None = None
    # the model step that produced the token(s), and actor pacing since this choice's previous token
    step: StepTiming | None = None
    idle_ms: float = 0.0
    # the choice's actor-side timings so far, on its first token's event and on the finishing event
    stats: ChoiceStats | None = None


@dataclass
class _Choice:
    seq: Sequence
    index: int
    detok: IncrementalDetokenizer
    stop: StopMatcher
    emit: Callable[[ChoiceEvent], None]
    request_id: str
    budget: ThinkingBudgetController | None = None
    stats: ChoiceStats = field(default_factory=lambda: ChoiceStats(time.perf_counter()))
    idle_ms: float = 0.0  # pacing since the previous token
    last_token_at: float | None = None  # perf_counter() of this choice's previous token (decode ITL)


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    emit: Callable[[ChoiceEvent], None]
    budgets: list[ThinkingBudgetController | None] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    adapter: AdapterTarget | None = None
    grammar: CompiledGrammar | None = None
    grammar_gate: list[int] | None = None   # token ids after which the grammar starts (a reasoning close)


@dataclass
class _SubmitMany:
    """Several requests admitted in one inbox drain, so they start in the same step (batch endpoint)."""

    items: list[_Submit]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Score:
    token_ids: list[int]
    top_k: int
    done: Callable[[PromptScores | None, Exception | None], None]
    adapter: AdapterTarget | None = None


@dataclass
class EngineCounters:
    """Monotonic totals for /metrics."""

    steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    requests_admitted: int = 0
    prompts_scored: int = 0


class EngineActor:
    """The actor thread: schedule a step, run it, turn sampled tokens into choice events."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, block_size: int, num_blocks: int,
                 max_num_seqs: int, max_batch_tokens: int, enable_prefix_caching: bool = True,
                 prefill_cost_with_decodes: int = 0, itl_pacing: ItlPacing = ItlPacing(0.0),
                 decode_stats: DecodeWindow | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_batch_tokens, prefill_cost_with_decodes,
                                   itl_pacing.pacer())
        self.lora_slots = LoraSlots(runner.model)
        self._inbox: queue.Queue = queue.Queue()
        self._choices: dict[int, _Choice] = {}
        self._outbox = Outbox()   # token events of the last step, handed over as the next one starts
        self._by_request: dict[str, list[_Choice]] = {}
        self._seq_ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.steps = 0
        self.last_step_at = time.monotonic()
        self.counters = EngineCounters()
        # per-sequence inter-token gaps over a rolling window (GET /v1/stats/decode)
        self.decode_stats = decode_stats or DecodeWindow()
        self.prewarmed = False
        self.warm_up_done = threading.Event()   # set once the warm-up has run (or failed)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Block until the actor thread ends (after `shutdown`)."""
        self._thread.join()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- called from other threads ---------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: list[SamplingParams],
               emit: Callable[[ChoiceEvent], None],
               budgets: list[ThinkingBudgetController | None] | None = None,
               adapter: AdapterTarget | None = None) -> None:
        self._inbox.put(_Submit(request_id, prompt_ids, params, emit, budgets, adapter=adapter))

    def submit_many(self, requests: list[tuple[str, list[int], list[SamplingParams], Callable[[ChoiceEvent], None],
                                               list[ThinkingBudgetController | None] | None,
                                               AdapterTarget | None, CompiledGrammar | None, list[int] | None]]
                    ) -> None:
        """Submit several requests as one inbox message: they join the batch at the same step."""
        now = time.perf_counter()
        self._inbox.put(_SubmitMany([_Submit(*r[:5], submitted_at=now, adapter=r[5], grammar=r[6], grammar_gate=r[7])
                                     for r in requests]))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def score(self, token_ids: list[int], top_k: int,
              done: Callable[[PromptScores | None, Exception | None], None],
              adapter: AdapterTarget | None = None) -> None:
        """Score a prompt's log-probs on the actor thread between steps, under `adapter` when given;
        `done(result, error)`."""
        self._inbox.put(_Score(token_ids, top_k, done, adapter))

    # -- the actor -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.runner.warmup()
            self.prewarmed = True
        except Exception:  # noqa: BLE001 - a failed warm-up only costs the first request some time
            log.exception("engine warm-up failed")
        finally:
            self.warm_up_done.set()
        was_working = False
        while not self._stop.is_set():
            try:
                working = self.scheduler.has_work()
                if not working:
                    self._outbox.flush()   # no next step to carry the last one's events
                    if was_working:
                        # a prompt's freed temporaries (~100 MB at 1B) stay in glibc's heap: hand them
                        # back as the engine goes idle, so an idle server holds what it serves with
                        trim_heap()
                was_working = working
                self._drain_inbox(block=not working)
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
            elif isinstance(msg, _SubmitMany):
                for item in msg.items:
                    self._admit(item)
            elif isinstance(msg, _Abort):
                self._abort(msg.request_id)
            elif isinstance(msg, _Score):
                self._score(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _score(self, msg: _Score) -> None:
        result: PromptScores | None = None
        error: Exception | None = None
        slot = 0
        try:
            if msg.adapter is not None:
                # pinned for the one forward, as a sequence pins it for its lifetime
                slot, _ = self.lora_slots.acquire(msg.adapter)
            result = self.runner.score(msg.token_ids, msg.top_k, slot)
            self.counters.prompts_scored += 1
        except Exception as e:  # noqa: BLE001 - handed to the waiting handler
            error = e
        finally:
            self.lora_slots.release(slot)
        try:
            msg.done(result, error)
        except RuntimeError:  # the handler's loop is gone (timed out or shut down)
            log.debug("scoring result had no one waiting")

    def _admit(self, msg: _Submit) -> None:
        first: Sequence | None = None
        choices: list[_Choice] = []
        received = time.perf_counter()
        self.counters.requests_admitted += 1
        for index, params in enumerate(msg.params):
            seq = Sequence(next(self._seq_ids), list(msg.prompt_ids), params)
            seq.wait_for = first  # later choices reuse the first choice's prompt blocks
            if msg.grammar is not None:
                seq.grammar = msg.grammar.start(msg.grammar_gate)
            if msg.adapter is not None:
                # Bound here, between steps: the revision stays pinned until this sequence ends.
                seq.lora_slot, seq.adapter_slot = self.lora_slots.acquire(msg.adapter)
            first = first or seq
            choice = _Choice(seq, index, IncrementalDetokenizer(self.tokenizer, msg.prompt_ids),
                             StopMatcher(params.stop), msg.emit, msg.request_id,
                             msg.budgets[index] if msg.budgets else None,
                             ChoiceStats(msg.submitted_at, received_at=received))
            choices.append(choice)
            if params.max_tokens <= 0:
                self.lora_slots.release(seq.lora_slot)
                msg.emit(ChoiceEvent(index, "", [], [], finish_reason="length", delivered_at=time.perf_counter(),
                                     stats=choice.stats.snapshot()))
                continue
            self._choices[seq.seq_id] = choice
            self.scheduler.add(seq)
        self._by_request[msg.request_id] = choices

    def _abort(self, request_id: str) -> None:
        for choice in self._by_request.pop(request_id, []):
            if self._choices.pop(choice.seq.seq_id, None) is not None:
                self.scheduler.abort(choice.seq.seq_id)
                self.runner.release(choice.seq.seq_id)
                self.lora_slots.release(choice.seq.lora_slot)

    def _step(self) -> None:
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.items:
            self._outbox.flush()
            time.sleep(0.001)  # waiting work that cannot be admitted yet
            idle = (time.perf_counter() - started) * 1000.0
            for choice in self._choices.values():
                choice.stats.idle_ms += idle
                choice.idle_ms += idle
            return
        prefilling = {it.seq.seq_id: it.is_prefill for it in out.items}
        for it in out.items:
            choice = self._choices.get(it.seq.seq_id)
            if choice is not None and choice.stats.admitted_at is None:
                choice.stats.admitted_at = started
        results, timing = self.runner.step(out, launched=self._outbox.flush)
        step_ms = (time.perf_counter() - started) * 1000.0
        self.scheduler.observe(out, step_ms)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d decodes, %d prompt tokens in %d chunks (price %.0f), %d waiting: %.1f ms",
                      self.steps, out.num_decodes, out.num_batched_tokens - out.num_decodes,
                      len(out.items) - out.num_decodes, out.prefill_price, self.scheduler.num_waiting, step_ms)
        self._account(out, prefilling, timing, results)
        for seq_id, res in results.items():
            choice = self._choices.get(seq_id)
            if choice is not None and choice.budget is not None:
                decided = choice.budget.step(choice.seq.output_token_ids, res.token_id)
                if decided.forced:
                    res.token_id, res.logprob, res.forced = decided.token_id, None, True
            if choice is not None and choice.seq.grammar is not None:
                choice.seq.grammar.advance(res.token_id)
        self.scheduler.on_step_done(out, {sid: r.token_id for sid, r in results.items()})
        now = time.perf_counter()
        self.steps += 1
        self.last_step_at = time.monotonic()
        gaps = []
        for seq_id, res in results.items():
            choice = self._choices.get(seq_id)
            if choice is not None:
                if choice.last_token_at is not None:
                    gaps.append(now - choice.last_token_at)
                choice.last_token_at = now
                if choice.seq.grammar is not None and choice.seq.grammar.error is not None:
                    self._fail_choice(choice, choice.seq.grammar.error, timing)
                    continue
                self._on_token(choice, res.token_id, res.logprob, now, res.forced, timing)
        self.decode_stats.record_step(now, gaps)

    def _account(self, out, prefilling: dict[int, bool], timing: StepTiming, results: dict) -> None:
        """Charge the step to each request it carried (a shared step counts fully for each)."""
        for it in out.items:
            choice = self._choices.get(it.seq.seq_id)
            if prefilling[it.seq.seq_id]:
                self.counters.prefill_tokens += it.num_new_tokens
            if choice is None:
                continue
            stats = choice.stats
            if prefilling[it.seq.seq_id]:
                stats.prefill_ms += timing.forward_ms
                stats.prefill_tokens += it.num_new_tokens
                stats.cached_tokens = max(stats.cached_tokens, it.seq.num_cached_tokens)
            else:
                stats.decode_ms += timing.forward_ms
            if it.seq.seq_id in results:
                stats.sampling_ms += timing.sampling_ms
                stats.readback_ms += timing.readback_ms
        self.counters.steps += 1
        self.counters.tokens_generated += len(results)

    def _on_token(self, choice: _Choice, token: int, logprob: float | None, now: float,
                  forced: bool = False, step: StepTiming | None = None) -> None:
        seq, params = choice.seq, choice.seq.params
        finish: str | None = None
        text = ""
        if not params.ignore_eos and token in params.stop_token_ids:
            finish = "stop"
            text = choice.stop.feed(choice.detok.flush())[0] + choice.stop.flush()
        elif seq.grammar is not None and seq.grammar.done:
            # the grammar is complete: the only token it allows next is EOS, so the choice ends here
            text, stopped = choice.stop.feed(choice.detok.step(token))
            if not stopped:
                tail, stopped = choice.stop.feed(choice.detok.flush())
                text += tail if stopped else tail + choice.stop.flush()
            finish = "stop"
        else:
            text, stopped = choice.stop.feed(choice.detok.step(token))
            if stopped:
                finish = "stop"
            elif seq.num_output_tokens >= params.max_tokens:
                tail, stopped = choice.stop.feed(choice.detok.flush())
                text += tail if stopped else tail + choice.stop.flush()
                finish = "stop" if stopped else "length"
        outcome = None
        first = choice.stats.first_token_at is None
        if first:
            choice.stats.first_token_at = now
        if finish is not None:
            self._finish(choice, finish)
            if choice.budget is not None:
                outcome = choice.budget.outcome(seq.num_output_tokens)
        idle, choice.idle_ms = choice.idle_ms, 0.0
        # delivered_at is set when the outbox hands the event over
        self._outbox.post(choice.emit, ChoiceEvent(
            choice.index, text, [token], [logprob], finish, [now], forced=[forced], budget_outcome=outcome,
            step=step, idle_ms=idle,
            # the first token's event carries queue/admission/prefill times for its timing event; the
            # last one carries the totals
            stats=choice.stats.snapshot() if first or finish is not None else None))

    def _finish(self, choice: _Choice, reason: str) -> None:
        self._choices.pop(choice.seq.seq_id, None)
        self.scheduler.finish(choice.seq, reason)
        self.runner.release(choice.seq.seq_id)
        self.lora_slots.release(choice.seq.lora_slot)
        siblings = self._by_request.get(choice.request_id, [])
        if all(c.seq.seq_id not in self._choices for c in siblings):
            self._by_request.pop(choice.request_id, None)

    def _fail_choice(self, choice: _Choice, message: str, step: StepTiming | None = None) -> None:
        """One choice ends in error (its grammar failed); its batch-mates go on."""
        log.warning("request %s choice %d failed: %s", choice.request_id, choice.index, message)
        self.runner.grammar_counters.failures += 1
        self._finish(choice, "error")
        self._outbox.post(choice.emit, ChoiceEvent(choice.index, "", [], [], "error", error=message, step=step,
                                                   stats=choice.stats.snapshot()))

    def _fail_all(self, message: str) -> None:
        self._outbox.flush()   # what was sampled before the failure comes first
        for choice in list(self._choices.values()):
            self._finish(choice, "error")
            choice.emit(ChoiceEvent(choice.index, "", [], [], "error", error=message,
                                    delivered_at=time.perf_counter(), stats=choice.stats.snapshot()))


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: list[SamplingParams]
    budgets: list[ThinkingBudgetController | None] | None = None
    request_id: str | None = None
    adapter: AdapterTarget | None = None
    grammar: CompiledGrammar | None = None
    grammar_gate: list[int] | None = None


class ActorBridge:
    """The asyncio side of the actor's queues: `async for i, event in bridge.submit([...])`."""

    def __init__(self, actor: EngineActor) -> None:
        self.actor = actor
        self._ids = itertools.count(1)

    async def generate(self, prompt_ids: list[int], params: list[SamplingParams],
                       request_id: str | None = None,
                       budgets: list[ThinkingBudgetController | None] | None = None,
                       adapter: AdapterTarget | None = None) -> AsyncIterator[ChoiceEvent]:
        async for _, ev in self.submit([GenerationRequest(prompt_ids, params, budgets, request_id, adapter)]):
            yield ev

    async def submit(self, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, ChoiceEvent]]:
        """Events of several requests, submitted to the actor at once, as (request index, event)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, ChoiceEvent]] = asyncio.Queue()
        rids = [r.request_id or f"req-{next(self._ids)}" for r in requests]
        pending = {(i, c) for i, r in enumerate(requests) for c in range(len(r.params))}

        def emitter(i: int) -> Callable[[ChoiceEvent], None]:
            return sink_emit(loop, lambda ev: events.put_nowait((i, ev)))

        self.actor.submit_many([(rid, r.prompt_ids, r.params, emitter(i), r.budgets, r.adapter, r.grammar,
                                 r.grammar_gate)
                                for i, (rid, r) in enumerate(zip(rids, requests, strict=True))])
        try:
            while pending:
                i, ev = await events.get()
                ev.received_at = time.perf_counter()
                if ev.finish_reason is not None:
                    pending.discard((i, ev.index))
                yield i, ev
        finally:
            # the consumer went away (client disconnect): free the blocks now
            for i in sorted({i for i, _ in pending}):
                self.actor.abort(rids[i])

    async def score(self, token_ids: list[int], top_k: int, adapter: AdapterTarget | None = None) -> PromptScores:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[PromptScores] = loop.create_future()

        def done(result: PromptScores | None, error: Exception | None) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)  # type: ignore[arg-type]
            loop.call_soon_threadsafe(settle)

        self.actor.score(token_ids, top_k, done, adapter)
        return await fut
