"""Run one plan on the served model, in the calling (training) thread, and publish the adapter.

Work that needs more than the loop says so: `prepare(model, lora, should_stop)` runs once before the
first step, on the starting factors (DPO's reference log-probabilities), and `evaluate(model, lora)`
once after the last, its result recorded as the job's `held_out` (DPO's held-out pairs); when
`blocks_activation(held_out)` gives a reason, auto_load is skipped and the reason recorded.

The base weights are the ones the serving actor uses -- no copy -- frozen (requires_grad False) and
never written: only the LoRA factors get gradients. The actor keeps serving meanwhile; the loop
yields at every step and, on CPU, leaves the actor a core of its own whenever it has work (`CoreShare`:
decided again before every step; an idle server lends training every core). On success the adapter is saved atomically (PEFT files, receipt, manifest) and,
with auto_load (and no post-training gate pending), made the server default through the active-adapter holder, whose callbacks swap it
into the engine (requests already running finish on the weights they started with).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kiln.adapters.active import model_spec_for
from kiln.adapters.peft_format import config_dict
from kiln.errors import KilnError
from kiln.store.clock import utc_now_rfc3339
from kiln.train.checkpoint import PROGRESS_FIELDS, CheckpointStore, TrainState
from kiln.train.jobs import TrainJob
from kiln.train.loop import LoopState, StepReport, run_loop
from kiln.train.memory import PeakTracker
from kiln.train.plan import TrainingPlan
from kiln.train.receipt import build_lineage, build_receipt
from kiln.train.trainable_lora import TrainableLora, freeze_base

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

log = logging.getLogger("kiln.train")

# Intra-op threads as the process started with (read at import, in the main thread): on CPU the
# training thread takes one fewer while the serving actor has work, so it always has a core to itself.
_PROCESS_THREADS = torch.get_num_threads()


def engine_busy(engine: EngineView) -> bool:
    """Whether the serving actor has sequences to step or completions in flight (lock-free reads)."""
    s = engine.scheduler_snapshot()
    return bool(s.get("running", 0) or s.get("waiting", 0) or engine.in_flight)


# A model this narrow trains on one thread while the server is idle, on a machine of at most
# SMALL_MODEL_MAX_CORES cores (see CoreShare).
SMALL_MODEL_HIDDEN = 1024
SMALL_MODEL_MAX_CORES = 2


@dataclass
class CoreShare:
    """The training thread's intra-op threads, chosen before each step: one fewer than the process's
    while the engine serves (measured on 2 cores forced to AVX2: a learning-loop step takes ~1.7 s on
    one thread and ~0.9 s on two; a request arriving mid-step shares the cores until that step ends,
    and the next step leaves the actor its core), and all of them while it is idle -- except for a
    narrow model on a small machine (`small_model`), which trains on one. The training thread is not
    the process's first OpenMP thread: with the actor's and the loader's thread teams alive, libgomp
    manages more threads than there are cores and throttles its workers' spinning to 100 iterations,
    so every parallel region wakes them from a futex (an elementwise op on 200k floats: 22 us on the
    main thread, 140 us on a side thread with two threads, 36 us with one; 2-core Zen 4). A step of
    thousands of small operations (SmolLM2-135M, hidden 576: 0.50 s on two threads, 0.39 s on one)
    then runs faster on one thread; a step of large products (a 1B model, hidden 2048) on two. The
    choice depends only on the model and the machine, so a resumed job runs every step on the thread
    count the uninterrupted one did."""

    engine: EngineView
    total: int = _PROCESS_THREADS
    current: int = 0
    small_model: bool = False

    def threads(self) -> int:
        if engine_busy(self.engine):
            return max(1, self.total - 1)
        if self.small_model and self.total <= SMALL_MODEL_MAX_CORES:
            return 1
        return self.total

    def __call__(self) -> None:
        n = self.threads()
        if n != self.current:
            torch.set_num_threads(n)  # this thread only
            self.current = n


@dataclass
class JobContext:
    """What a job needs from the server; built when the job starts (the model may load after submission)."""

    engine: EngineView
    adapters: Any               # AdapterStore
    active: Any | None = None   # ActiveAdapter


def served_model(engine: EngineView) -> torch.nn.Module:
    return engine.model


def _trainable_rotary(model: torch.nn.Module) -> None:
    # Tables built under the actor's inference_mode cannot be saved for backward; the values are the
    # same, so swap in ordinary copies (one attribute store each, safe against the reading actor).
    rotary = getattr(model, "rotary", None)
    if rotary is None:
        return
    for name in ("cos", "sin_signed"):
        t = getattr(rotary, name, None)
        if isinstance(t, torch.Tensor) and t.is_inference():
            setattr(rotary, name, t.clone())


@dataclass
class Checkpointing:
    """Where a job's checkpoints go, how often, and when to stop at the next batch boundary (shutdown)."""

    store: CheckpointStore
    every_steps: int = 0                           # 0: only when pausing
    should_pause: Callable[[], bool] = lambda: False
    saved: Callable[[], None] = lambda: None       # after each checkpoint: persist the job record now


def execute(job: TrainJob, plan: TrainingPlan, ctx: JobContext, *, on_update: Callable[[], None],
            should_stop: Callable[[], bool], checkpointing: Checkpointing | None = None) -> None:
    """Train, save, activate. Mutates `job` (progress, loss, results); raises Cancelled, Paused or an error.

    With `checkpointing`, a saved state of this job is continued from (factors, optimizer, data position,
    progress), and new states are saved every `every_steps` steps and when pausing."""
    model = served_model(ctx.engine)
    freeze_base(model)
    _trainable_rotary(model)
    param = next(model.parameters())
    share_cores = (CoreShare(ctx.engine, small_model=model.config.hidden_size < SMALL_MODEL_HIDDEN)
                   if param.device.type == "cpu" else None)
    if share_cores is not None:
        share_cores()
    base_dtype = str(param.dtype).removeprefix("torch.")
    lora = TrainableLora(model.config, plan.lora.rank, plan.lora.alpha, plan.lora.target_modules,
                         device=param.device, seed=plan.lora.seed)
    if plan.lora.base_factors is not None:
        lora.load_factors(plan.lora.base_factors)
    prepare = getattr(plan.work, "prepare", None)
    if prepare is not None:
        # DPO's frozen reference is the job's starting point: these factors before any step (also on resume).
        prepare(model, lora, should_stop)
    resume = checkpointing.store.load_state(job.job_id) if checkpointing is not None else None
    if resume is not None:
        lora.load_state_dict(resume.factors)
        for key in PROGRESS_FIELDS:
            if key in resume.progress:
                setattr(job, key, resume.progress[key])
        job.resumed_from_step = resume.loop.step
        log.info("training job %s continues from its checkpoint at step %d", job.job_id, resume.loop.step)
    elif job.step or job.loss_curve:
        # A resumed job with no checkpoint yet starts over: forget the lost run's progress.
        job.step, job.epoch, job.progress, job.tokens_trained, job.loss_curve = 0, 0, 0.0, 0, []
        job.current_loss, job.metrics = None, {}
    job.total_steps = plan.loop.total_steps(len(plan.work.items))
    memory = PeakTracker()
    job.memory = {"rss_start_mb": round(memory.start_mb, 1), "rss_peak_mb": round(memory.start_mb, 1),
                  "peak_is_high_water_mark": memory.exact}
    t0 = time.perf_counter()

    def step_done(r: StepReport) -> None:
        job.step, job.epoch = r.step, r.epoch
        job.progress = r.step / max(r.total_steps, 1)
        job.current_loss = r.loss
        job.tokens_per_sec = round(r.tokens_per_sec, 2)
        job.tokens_trained += r.tokens
        job.elapsed_secs = round(r.elapsed_secs, 3)
        job.metrics = {k: round(v, 6) for k, v in r.metrics.items()}
        job.add_point({"step": r.step, "epoch": r.epoch, "loss": r.loss, **job.metrics})
        job.memory["rss_peak_mb"] = round(memory.sample(), 1)
        on_update()

    def save_checkpoint(state: LoopState) -> None:
        assert checkpointing is not None
        progress = {key: getattr(job, key) for key in PROGRESS_FIELDS}
        checkpointing.store.save_state(job.job_id, TrainState(state, lora.state_dict(), progress))
        job.checkpoint = {"step": state.step, "saved_at": utc_now_rfc3339()}
        checkpointing.saved()

    run_loop(model, lora, plan.work, plan.loop, on_step=step_done, should_stop=should_stop,
             resume=resume.loop if resume is not None else None,
             checkpoint_every=checkpointing.every_steps if checkpointing is not None else 0,
             on_checkpoint=save_checkpoint if checkpointing is not None else None,
             should_pause=checkpointing.should_pause if checkpointing is not None else None,
             before_step=share_cores)
    evaluate = getattr(plan.work, "evaluate", None)
    if evaluate is not None:
        job.held_out = evaluate(model, lora)
    duration = time.perf_counter() - t0
    finished = utc_now_rfc3339()
    receipt = build_receipt(job, plan, ctx.engine, finished_at=finished, duration_secs=duration, base_dtype=base_dtype)
    served_id = receipt["base_model"]["served_model_id"]
    adapter_config = config_dict(plan.lora.rank, plan.lora.alpha, plan.lora.target_modules,
                                 base_model_name_or_path=served_id)
    info = ctx.adapters.save_adapter(plan.adapter_name, lora.factors(), adapter_config, receipt,
                                     lineage=build_lineage(plan, ctx.engine, base_dtype), overwrite=plan.overwrite)
    job.adapter_path = str(ctx.adapters.path(plan.adapter_name))
    job.train_receipt = {k: v for k, v in receipt.items() if k != "loss_curve"}
    job.train_receipt["adapter_content_sha256"] = info.content_sha256
    job.progress = 1.0
    # With a post-training gate, activation waits for the gate's verdict (gate_actions.py).
    blocked = getattr(plan.work, "blocks_activation", lambda _: None)(job.held_out)
    if plan.auto_load and not plan.gated and blocked is not None:
        job.activated, job.activation_error = False, blocked
    elif plan.auto_load and not plan.gated:
        activate(job, plan.adapter_name, ctx)


def activate(job: TrainJob, name: str, ctx: JobContext) -> None:
    """Make `name` the server default (hot swap); the outcome goes to job.activated / activation_error."""
    if ctx.active is None:
        job.activated, job.activation_error = False, "this server has no active-adapter holder"
        return
    try:
        ctx.active.load(name, model_spec_for(ctx.engine))
        job.activated, job.activation_error = True, None
    except KilnError as e:
        log.warning("training job %s: activating %s failed: %s", job.job_id, name, e.message)
        job.activated, job.activation_error = False, e.message
