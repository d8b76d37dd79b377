"""The optimisation loop shared by SFT, GRPO and DPO: epochs of shuffled items, micro-batches with gradient
accumulation, AdamW on the LoRA factors only (kiln.train.optim: torch's update without torch.optim, which
imports torch's compiler), a cancel check and a yield at every step boundary.

A step takes `batch_size * grad_accum` items, split into `grad_accum` micro-batches. Each micro-batch
loss is already divided by the step's trained-token count (or, for work with a `weight` per item, the
step's total weight: DPO's pairs), so the accumulated gradient is that of the step mean. Between
steps the thread sleeps briefly: the serving actor shares the CPU
(or GPU) and must keep answering while a job runs.

Resumable: at a batch boundary the loop can hand out a `LoopState` (optimizer state, the shuffle
generator's state at the start of the epoch, the position in it, the global RNG) every
`checkpoint_every` optimizer steps, and when `should_pause` says so (a graceful shutdown), after which
it raises `Paused`. Started again with that state (and the factors saved beside it), it runs the
remaining batches exactly as the uninterrupted run would have: same order, same optimizer moments,
bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from kiln.model.lora import LoraDelta
from kiln.train.optim import AdamW


class Work(Protocol):
    @property
    def items(self) -> Sequence[Any]: ...

    def tokens(self, item: Any) -> int: ...

    def loss(self, model: torch.nn.Module, lora: LoraDelta, items: Sequence[Any], normalizer: int,
             memo: dict[str, Any]) -> tuple[Tensor, dict[str, float]]: ...


@dataclass
class LoopConfig:
    learning_rate: float
    epochs: int = 1
    batch_size: int = 1
    grad_accum: int = 1
    seed: int = 0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    updates_per_step: int = 1        # GRPO's mu: optimizer updates on the same batch
    yield_secs: float = 0.002

    def steps_per_epoch(self, n_items: int) -> int:
        return math.ceil(n_items / (self.batch_size * self.grad_accum))

    def total_steps(self, n_items: int) -> int:
        return self.epochs * self.steps_per_epoch(n_items) * self.updates_per_step


@dataclass
class StepReport:
    step: int               # 1-based optimizer updates done
    total_steps: int
    epoch: int              # 1-based
    loss: float
    tokens: int             # trained tokens in this step
    tokens_per_sec: float
    elapsed_secs: float
    metrics: dict[str, float] = field(default_factory=dict)


class Cancelled(Exception):
    """The job was cancelled; raised at a step boundary, before the next update."""


class Paused(Exception):
    """The loop stopped at a batch boundary on request, after handing out its state (shutdown)."""


@dataclass
class LoopState:
    """Where a run stands at a batch boundary: enough to continue it bit for bit."""

    step: int                        # optimizer updates done
    epoch: int                       # 1-based epoch the next batch belongs to
    batch: int                       # index of the next batch within that epoch
    shuffle_state: Tensor            # the shuffle generator's state before that epoch's permutation
    optimizer: dict[str, Any]        # AdamW state_dict (moments, step counts)
    rng_state: Tensor                # torch's global CPU RNG (nothing here draws from it today)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "batch": self.batch, "shuffle_state": self.shuffle_state,
                "optimizer": self.optimizer, "rng_state": self.rng_state}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoopState:
        return cls(int(d["step"]), int(d["epoch"]), int(d["batch"]), d["shuffle_state"], d["optimizer"],
                   d["rng_state"])


def _batches(n: int, cfg: LoopConfig, gen: torch.Generator) -> list[list[int]]:
    per_step = cfg.batch_size * cfg.grad_accum
    order = torch.randperm(n, generator=gen).tolist()
    return [order[i : i + per_step] for i in range(0, n, per_step)]


def run_loop(model: torch.nn.Module, lora: torch.nn.Module, work: Work, cfg: LoopConfig, *,
             on_step: Callable[[StepReport], None] | None = None,
             should_stop: Callable[[], bool] | None = None,
             resume: LoopState | None = None, checkpoint_every: int = 0,
             on_checkpoint: Callable[[LoopState], None] | None = None,
             should_pause: Callable[[], bool] | None = None,
             before_step: Callable[[], None] | None = None) -> list[StepReport]:
    """Run the remaining steps (all of them, or those after `resume`); returns this call's reports.
    `before_step` runs before each step (the executor re-decides its CPU threads there)."""
    items = list(work.items)
    params = [p for p in lora.parameters() if p.requires_grad]
    opt = AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    total = cfg.total_steps(len(items))
    reports: list[StepReport] = []
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    step, first_epoch, first_batch = 0, 1, 0
    if resume is not None:
        opt.load_state_dict(resume.optimizer)
        gen.set_state(resume.shuffle_state)
        torch.set_rng_state(resume.rng_state)
        step, first_epoch, first_batch = resume.step, resume.epoch, resume.batch
    last_checkpoint = step
    model.train(False)
    for epoch in range(first_epoch, cfg.epochs + 1):
        epoch_state = gen.get_state()
        batches = _batches(len(items), cfg, gen)
        for b in range(first_batch if epoch == first_epoch else 0, len(batches)):
            pause = should_pause is not None and should_pause()
            due = checkpoint_every > 0 and step - last_checkpoint >= checkpoint_every
            if on_checkpoint is not None and step > last_checkpoint and (pause or due):
                on_checkpoint(LoopState(step, epoch, b, epoch_state.clone(), opt.state_dict(), torch.get_rng_state()))
                last_checkpoint = step
            if pause:
                raise Paused()
            if before_step is not None:
                before_step()
            step = _run_batch(model, lora, work, cfg, opt, params, [items[i] for i in batches[b]], epoch, step,
                              total, started, reports, on_step, should_stop)
    opt.zero_grad(set_to_none=True)
    return reports


def _run_batch(model: torch.nn.Module, lora: torch.nn.Module, work: Work, cfg: LoopConfig,
               opt: AdamW, params: list[Tensor], chosen: list[Any], epoch: int, step: int, total: int,
               started: float, reports: list[StepReport], on_step: Callable[[StepReport], None] | None,
               should_stop: Callable[[], bool] | None) -> int:
    micro = [chosen[i : i + cfg.batch_size] for i in range(0, len(chosen), cfg.batch_size)]
    tokens = sum(work.tokens(it) for it in chosen)
    # What the step's loss is a mean over: trained tokens (SFT, GRPO), or the work's own weights (DPO: pairs).
    weight = getattr(work, "weight", None)
    normalizer = sum(weight(it) for it in chosen) if weight is not None else tokens
    memos: list[dict[str, Any]] = [{} for _ in micro]
    for _ in range(cfg.updates_per_step):
        if should_stop is not None and should_stop():
            raise Cancelled()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        metrics: dict[str, float] = {}
        for mb, memo in zip(micro, memos, strict=True):
            loss, extra = work.loss(model, lora, mb, normalizer, memo)
            loss.backward()
            loss_sum += float(loss.detach())
            for k, v in extra.items():
                metrics[k] = metrics.get(k, 0.0) + v
            time.sleep(0)  # let the serving thread in between micro-batches
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"the loss became {loss_sum} at step {step + 1}; lower the learning rate")
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        step += 1
        dt = max(time.perf_counter() - t0, 1e-9)
        report = StepReport(step, total, epoch, loss_sum, tokens, tokens / dt,
                            time.perf_counter() - started, metrics)
        reports.append(report)
        if on_step is not None:
            on_step(report)
        time.sleep(cfg.yield_secs)
    return step
