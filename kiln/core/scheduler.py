"""Continuous batching: which sequences run in the next model step, and how many tokens each feeds.

Each step has a token budget (`max_batch_tokens`). Policy, in order:
1. running decodes, one token each, oldest first; when the pool cannot hold a decode's next token,
   the most recently arrived running sequence is preempted (recompute: it loses its blocks and goes
   back to the front of the waiting queue, keeping its generated tokens) and the decode retries;
2. running prefills continue with the next chunk of their prompt;
3. waiting sequences are admitted FIFO while budget, `max_num_seqs` and free blocks allow. A waiting
   sequence whose `wait_for` has not computed its prompt yet is passed over, so it can later share
   that prompt through the prefix cache instead of computing it a second time.
When the step carries decodes, prompt chunks also share a prefill price (prefill_cost.py), which
keeps the decoding streams' inter-token gaps bounded while prompts arrive:
- with a `PrefillPacer` that has measured this engine's steps, the price that fits its time target,
  for every prompt (a short one too: on a slow code path a whole 500-token prompt is a long stall);
  a pacer made `below_fixed_price` only where its price is below the fixed one;
- otherwise the fixed `prefill_cost_with_decodes`, for prompts longer than one step's token budget
  only; 0 turns that off.
`observe` hands each finished step's wall time to the pacer.
The step lists one-token rows (decodes) first, grouped by adapter slot, then the prompt chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.core.block_manager import BlockManager
from kiln.core.prefill_cost import MIN_CHUNK, chunk_cost, tokens_within
from kiln.core.prefill_pacer import PrefillPacer
from kiln.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    sample: bool  # the chunk reaches the end: sample one token for it

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk (a first prefill, or a preempted sequence's recompute), not a decode."""
        return self.num_new_tokens > 1 or self.seq.num_computed_tokens < self.seq.num_prompt_tokens


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)  # num_new_tokens == 1 first, then chunks
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0
    prefill_price: float = 0.0  # chunk_cost of the step's prompt chunks


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


def _batch_key(item: ScheduledSeq) -> tuple[bool, int]:
    """Where an item goes in its step (a stable sort): one-token rows first, by LoRA slot; chunks after."""
    one = item.num_new_tokens == 1
    return (not one, item.seq.lora_slot if one else 0)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batch_tokens: int,
                 prefill_cost_with_decodes: int = 0, pacer: PrefillPacer | None = None) -> None:
        if max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(
                f"need max_num_seqs >= 1 and max_batch_tokens >= 1, got {max_num_seqs}, {max_batch_tokens}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.prefill_cost_with_decodes = max(0, prefill_cost_with_decodes)
        self.pacer = pacer
        self._cost_left: float | None = None   # this step's prefill price budget (None: unlimited)
        self._meter_all = False                # the budget prices short prompts too (the pacer's)
        self._chunked = False                  # a prefill chunk is already in this step
        self._whole_left: float | None = None  # a bounding pacer's price left for whole short prompts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens == 0:
            raise ValueError(f"sequence {seq.seq_id} has no tokens")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return  # the first reason stands (e.g. an abort racing a natural stop)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        self.running.sort(key=_arrival_key)
        scheduled: set[int] = set()

        # 1. Decodes. Victims are always the newest unscheduled running sequence, so a sequence
        # scheduled earlier in this loop (older) is never preempted after being scheduled.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.num_remaining != 1 or seq.status is not SequenceStatus.RUNNING:
                continue
            while not self.block_manager.can_append(seq, 1):
                victim = max((s for s in self.running if s.seq_id not in scheduled), key=_arrival_key)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, 1)
            self._emit(out, seq, 1)
            scheduled.add(seq.seq_id)
            budget -= 1

        out.num_decodes = len(out.items)
        self._price_step(out.num_decodes, self._queued())
        # 2. Running prefills continue before anything new is admitted.
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in scheduled or seq.num_remaining < 2:
                continue
            chunk = self._chunk(seq, budget)
            if chunk == 0:
                break
            self.block_manager.append(seq, chunk)  # no-op: allocate covered every token
            self._emit(out, seq, chunk)
            scheduled.add(seq.seq_id)
            budget -= chunk

        # 3. Admissions; none after a preemption, since the pool is evidently full.
        if not out.preempted:
            budget = self._admit(out, budget)

        # Decodes (and 1-token chunks, which attend exactly like decodes) lead the batch, grouped by
        # adapter (oldest first within one): a step split over threads by rows then gives each part
        # fewer adapters' factors to read (every row's values are the same in any order).
        out.items.sort(key=_batch_key)
        out.num_batched_tokens = self.max_batch_tokens - budget
        return out

    def _queued(self) -> int:
        """Prompts waiting for their first token: not admitted yet, or admitted with prompt left."""
        return len(self.waiting) + sum(1 for s in self.running if not s.prompt_computed)

    def _price_step(self, decodes: int, queued: int = 0) -> None:
        """This step's prefill price budget: none without decodes, else the pacer's (a queue of
        `queued` prompts lets it aim higher) or the fixed one (a pacer that only bounds the fixed price
        gives its own where it is the smaller)."""
        paced = self.pacer.price_budget(decodes, queued) if decodes and self.pacer is not None else None
        self._whole_left = None
        if (paced is not None and self.pacer is not None and self.pacer.below_fixed_price
                and self.prefill_cost_with_decodes and paced >= self.prefill_cost_with_decodes):
            # the fixed price's steps fit the pacer's aim: it stands, but a short prompt goes whole
            # only while it fits the pacer's price too (a whole 100-token prompt beside a 1B model's
            # decodes is a 350 ms gap)
            self._whole_left, paced = paced, None
        if paced is not None:
            self._cost_left, self._meter_all = paced, True
        elif decodes and self.prefill_cost_with_decodes:
            self._cost_left, self._meter_all = float(self.prefill_cost_with_decodes), False
        else:
            self._cost_left, self._meter_all = None, False
        self._chunked = False

    def observe(self, out: SchedulerOutput, ms: float) -> None:
        """A step scheduled by `schedule` ran in `ms` of wall time (what its streams waited)."""
        if self.pacer is not None:
            self.pacer.observe(out.num_decodes, out.prefill_price, ms)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq`'s prompt to feed now: the token budget, then this step's prefill price."""
        n = min(seq.num_remaining, budget)
        if self._cost_left is None:
            return n
        start = seq.num_computed_tokens
        if seq.num_prompt_tokens <= self.max_batch_tokens and not self._meter_all:
            # Under the fixed price a prompt that fits one step goes whole (many short arrivals keep
            # their throughput); only long prompts are metered. It still spends the price a long one
            # would share. A bounding pacer's price caps what goes whole.
            fit = n
            if self._whole_left is not None:
                if chunk_cost(start, n) > self._whole_left:
                    fit = tokens_within(start, n, self._whole_left)
                    if not self._chunked:
                        fit = max(fit, min(n, MIN_CHUNK))
                self._whole_left = max(0.0, self._whole_left - chunk_cost(start, fit))
        else:
            fit = tokens_within(start, n, self._cost_left)
            if not self._chunked:
                fit = max(fit, min(n, MIN_CHUNK))   # a long prefix must still move forward
        self._cost_left = max(0.0, self._cost_left - chunk_cost(start, fit))
        self._chunked = self._chunked or fit > 0
        return fit

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._cost_left is not None and self._cost_left < 1 and self._chunked:
                break  # this step's prefill price is spent
            if not self._dependency_ready(seq):
                continue
            if not self.block_manager.can_allocate(seq):
                break  # FIFO: nothing behind the head may overtake it for blocks
            self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunk = self._chunk(seq, budget)
            if chunk == 0:
                break   # admitted (blocks held); its prompt starts next step
            self._emit(out, seq, chunk)
            budget -= chunk
        return budget

    @staticmethod
    def _dependency_ready(seq: Sequence) -> bool:
        dep = seq.wait_for
        if dep is None or dep.is_finished:
            return True
        return dep.status is SequenceStatus.RUNNING and dep.prompt_computed

    @staticmethod
    def _emit(out: SchedulerOutput, seq: Sequence, num_new_tokens: int) -> None:
        sample = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        item = ScheduledSeq(seq, num_new_tokens, sample)
        if item.is_prefill:
            out.prefill_price += chunk_cost(seq.num_computed_tokens, num_new_tokens)
        out.items.append(item)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def on_step_done(self, out: SchedulerOutput, sampled: dict[int, int]) -> None:
        """Record a finished step: K/V computed, blocks registered, sampled tokens appended."""
        for item in out.items:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished while the step ran
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.mark_computed(seq)
            if item.sample and seq.seq_id in sampled:
                seq.append_token(sampled[seq.seq_id])
