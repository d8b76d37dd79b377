"""The training queue: admission caps, one background worker thread, cancel, and job records.

Jobs run one at a time, in submission order, in a daemon thread beside the serving actor. Queue
caps answer 503 with Retry-After 30 (semantics.md §12.2). A running job is cancelled at its next step
boundary; a queued one leaves the queue at once. Every state change is persisted atomically.

Post-training gate (§8.14): a job with `post_eval` ends "completed" when its adapter is saved; a gated
one then shows gate_outcome "pending" while its eval job (queued through `eval_link`) runs, and the
eval manager's terminal-state listener (`on_eval_finished`) resolves the gate on a thread of its own,
so the training queue never waits for an eval. A gated job's webhook fires once the gate resolved.
A gate still pending at startup can never resolve: it is recorded as an error (fail closed).

Resumable jobs: with a checkpoint store, each job's request is kept beside its checkpoints
(saved every `checkpoint_every` steps). A job the process lost (crash) or paused (`pause`, the graceful
shutdown) is `interrupted`; `resume` queues it again with a plan built from the same request, and the
executor continues from the latest checkpoint. A job that ends for good drops its checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError
from kiln.evals.jobs import EvalJob
from kiln.store.clock import utc_now_rfc3339
from kiln.train.checkpoint import CheckpointStore
from kiln.train.errors import job_not_found
from kiln.train.eval_link import EvalLink, build_eval_job
from kiln.train.executor import Checkpointing, JobContext, execute
from kiln.train.gate_actions import (
    PENDING,
    interrupted,
    is_gated,
    mark_pending,
    report,
    resolve_gate,
    submission_failed,
)
from kiln.train.job_store import TrainJobStore
from kiln.train.jobs import CANCELLED, COMPLETED, FAILED, INTERRUPTED, QUEUED, RUNNING, TrainJob
from kiln.train.loop import Cancelled, Paused
from kiln.train.plan import TrainingPlan
from kiln.train.webhook import deliver, webhook_payload

log = logging.getLogger("kiln.train")

RETRY_AFTER = {"Retry-After": "30"}
SAVE_INTERVAL = 1.0
RECENT_COMPLETED = 20
MIN_PAUSE_SECS = 30.0


class TrainingManager:
    def __init__(self, store: TrainJobStore, context: Callable[[], JobContext], *, max_queued_jobs: int = 8,
                 max_tracked_jobs: int = 256, webhook_url: str | None = None,
                 send_webhook: Callable[[str, dict[str, Any]], dict[str, Any]] = deliver,
                 run: Callable[..., None] = execute, eval_link: EvalLink | None = None,
                 checkpoints: CheckpointStore | None = None, checkpoint_every: int = 0,
                 auto_resume: bool = False) -> None:
        self.store = store
        self.auto_resume = auto_resume   # the server resumes interrupted jobs once its model has loaded
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        self.context = context
        self.max_queued_jobs = max_queued_jobs
        self.max_tracked_jobs = max_tracked_jobs
        self.webhook_url = webhook_url
        self.send_webhook = send_webhook
        self.run = run
        self.eval_link = eval_link
        self._cond = threading.Condition()
        self._jobs: dict[str, TrainJob] = {}
        self._plans: dict[str, TrainingPlan] = {}
        self._queue: deque[str] = deque()
        self._running: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        # Called with a job when it ends and again when its post-training gate resolves (corrections
        # mark themselves trained from here); a listener that raises is logged, never the worker's problem.
        self.listeners: list[Callable[[TrainJob], None]] = []
        self._pausing = False

    # -- lifecycle -------------------------------------------------------------------------------
    def load_archived(self) -> int:
        resumable = self.checkpoints.has_request if self.checkpoints is not None else None
        jobs = self.store.load_all(keep=self.max_tracked_jobs, resumable=resumable)
        with self._cond:
            for job in jobs:
                self._jobs[job.job_id] = job
                if job.gate_outcome == PENDING:
                    interrupted(job)
                    self.store.save(job)
        return len(jobs)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def request_pause(self) -> None:
        """Take no more jobs; the running one stops (checkpointed) at its next batch boundary."""
        with self._cond:
            self._closed, self._pausing = True, True
            self._cond.notify_all()

    def pause(self, timeout: float) -> str | None:
        """Shutdown: take no more jobs, stop the running one at its next batch boundary after a checkpoint
        (it becomes `interrupted`), wait up to `timeout` seconds. Queued jobs stay queued on disk and come
        back interrupted. Returns the id of a job still running after the timeout, else None."""
        with self._cond:
            self._closed, self._pausing = True, True
            self._cond.notify_all()
            thread, running = self._thread, self._running
        if thread is not None and running is not None:
            thread.join(timeout)
            if thread.is_alive():
                return running
        return None

    def sweep(self) -> list[str]:
        """Startup sweep of the job records and the checkpoints."""
        return self.store.sweep() + (self.checkpoints.sweep() if self.checkpoints is not None else [])

    def pause_for_shutdown(self, seconds_left: float) -> None:
        """The shutdown hook: wait for the running job's checkpoint, at least MIN_PAUSE_SECS even when
        draining requests took the rest of the deadline (a step must not be cut off mid-write)."""
        still = self.pause(max(seconds_left, MIN_PAUSE_SECS))
        if still is not None:
            log.warning("training job %s did not reach a batch boundary in time; it continues from its last "
                        "checkpoint after a restart", still)

    def interrupted_jobs(self) -> list[TrainJob]:
        with self._cond:
            return [j for j in self._jobs.values() if j.state == INTERRUPTED]
    def _ensure_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="kiln-train", daemon=True)
            self._thread.start()

    # -- admission -------------------------------------------------------------------------------
    def check_capacity(self) -> None:
        """503 before any expensive preparation when the queue or the tracking table is full."""
        with self._cond:
            self._admission_problem()

    def _admission_problem(self) -> None:
        if len(self._queue) >= self.max_queued_jobs:
            raise KilnError(503, "training_queue_full",
                            f"the training queue is full ({self.max_queued_jobs} jobs waiting)",
                            hint="Retry later, or cancel a queued job (DELETE /v1/train/queue/{job_id}).",
                            headers=RETRY_AFTER)
        if len(self._jobs) >= self.max_tracked_jobs and not self._evict_finished():
            raise KilnError(503, "training_tracked_full",
                            f"the server tracks {self.max_tracked_jobs} unfinished training jobs already",
                            hint="Retry when some have finished.", headers=RETRY_AFTER)

    def _evict_finished(self) -> bool:
        for job_id, job in self._jobs.items():  # oldest first (insertion order)
            if job.terminal and job.gate_outcome != PENDING and job.state != INTERRUPTED:
                del self._jobs[job_id]
                self.store.delete(job_id)
                return True
        return False

    def _check_name_free(self, plan: TrainingPlan) -> None:
        # Two unfinished jobs writing one adapter would race; the later one is refused up front.
        # A pending gate still owns its adapter: retraining it now would change what the gate promotes.
        for other in self._jobs.values():
            owns = not other.terminal or other.gate_outcome == PENDING or other.state == INTERRUPTED
            if owns and other.adapter_name == plan.adapter_name and other.job_id != plan.job_id:
                raise KilnError(409, "adapter_already_exists",
                                f"training job {other.job_id} is already producing adapter {plan.adapter_name!r}",
                                param="config.output_name", hint="Pick another output_name or wait for that job.")

    def submit(self, plan: TrainingPlan, request: dict[str, Any] | None = None) -> TrainJob:
        """Queue a new job. `request` (the wire body) is kept so the job can be resumed after a crash."""
        job = TrainJob(job_id=plan.job_id, job_type=plan.job_type, adapter_name=plan.adapter_name,
                       config=plan.config, training_data={**plan.data.provenance(), **plan.stats},
                       submitted_at=utc_now_rfc3339(), base_adapter=plan.lora.base_adapter,
                       total_steps=plan.loop.total_steps(len(plan.work.items)), webhook_url=plan.webhook_url,
                       post_eval=plan.post_eval.settings if plan.post_eval is not None else None)
        with self._cond:
            if self._closed:
                raise KilnError(503, "server_shutting_down", "the server is shutting down", headers=RETRY_AFTER)
            self._admission_problem()
            self._check_name_free(plan)
            if self.checkpoints is not None and request is not None:
                body = {**request, "config": {**(request.get("config") or {}), "output_name": plan.adapter_name}}
                self.checkpoints.save_request(job.job_id, plan.job_type, body)
            self._jobs[job.job_id] = job
            self._plans[job.job_id] = plan
            self._queue.append(job.job_id)
            self.store.save(job)
            self._ensure_worker()
            self._cond.notify_all()
        log.info("queued %s job %s -> adapter %s (%d items)", job.job_type, job.job_id, job.adapter_name,
                 len(plan.work.items))
        return job

    def resume_request(self, job_id: str) -> tuple[TrainJob, str, dict[str, Any]]:
        """The interrupted job and its kept request (job type, body): what a resume plans from."""
        job = self.get(job_id)
        if job.state != INTERRUPTED:
            raise KilnError(409, "training_job_not_resumable", f"training job {job_id} is {job.state}",
                            param="job_id", hint="Only an interrupted job can be resumed.")
        kept = self.checkpoints.load_request(job_id) if self.checkpoints is not None else None
        if kept is None:
            raise KilnError(409, "training_job_not_resumable",
                            f"training job {job_id} kept no request to resume from", param="job_id",
                            hint="Submit the job again.")
        return job, kept[0], kept[1]

    def resume(self, plan: TrainingPlan) -> TrainJob:
        """Queue an interrupted job again; the executor continues from its latest checkpoint."""
        with self._cond:
            job = self._jobs.get(plan.job_id)
            if job is None:
                raise job_not_found(plan.job_id)
            if job.state != INTERRUPTED:
                raise KilnError(409, "training_job_not_resumable", f"training job {job.job_id} is {job.state}",
                                param="job_id", hint="Only an interrupted job can be resumed.")
            if self._closed:
                raise KilnError(503, "server_shutting_down", "the server is shutting down", headers=RETRY_AFTER)
            want = job.training_data.get("data_sha256")
            if want is not None and want != plan.data.sha256:
                raise KilnError(409, "training_data_changed",
                                f"the training data of job {job.job_id} changed since it started "
                                f"({plan.data.sha256} != {want})", param="job_id",
                                hint="Submit a new job to train on the current data.")
            if len(self._queue) >= self.max_queued_jobs:
                self._admission_problem()
            self._check_name_free(plan)
            job.state, job.error, job.finished_at, job.cancel_requested = QUEUED, None, None, False
            job.resumes += 1
            self._plans[job.job_id] = plan
            self._queue.append(job.job_id)
            self.store.save(job)
            self._ensure_worker()
            self._cond.notify_all()
        log.info("resuming training job %s (checkpoint at step %s)", job.job_id,
                 (job.checkpoint or {}).get("step", 0))
        return job

    # -- queries ---------------------------------------------------------------------------------
    def get(self, job_id: str) -> TrainJob:
        with self._cond:
            job = self._jobs.get(job_id)
        if job is None:
            raise job_not_found(job_id)
        return job

    def list(self) -> list[TrainJob]:
        with self._cond:
            return list(self._jobs.values())

    def queue_view(self) -> dict[str, Any]:
        with self._cond:
            running = self._jobs.get(self._running) if self._running else None
            queued = [self._jobs[j] for j in self._queue]
            done = [j for j in self._jobs.values() if j.terminal][-RECENT_COMPLETED:]
        return {
            "running": None if running is None else {
                "job_id": running.job_id, "job_type": running.job_type, "adapter_name": running.adapter_name,
                "progress": running.progress, "current_loss": running.current_loss},
            "queued": [{"job_id": j.job_id, "job_type": j.job_type, "adapter_name": j.adapter_name, "position": i + 1}
                       for i, j in enumerate(queued)],
            "completed": [{"job_id": j.job_id, "job_type": j.job_type, "adapter_name": j.adapter_name,
                           "state": j.state, "finished_at": j.finished_at} for j in reversed(done)],
        }

    def active_summary(self) -> dict[str, Any]:
        """For health/metrics: the running job and the queue length."""
        with self._cond:
            running = self._jobs.get(self._running) if self._running else None
            return {"active_job": None if running is None else {"job_id": running.job_id, "progress": running.progress},
                    "queued": len(self._queue)}

    # -- cancel / delete -------------------------------------------------------------------------
    def cancel_queued(self, job_id: str) -> dict[str, Any]:
        """DELETE /v1/train/queue/{id}: only a job still waiting."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                raise job_not_found(job_id)
            if job.state == RUNNING:
                raise KilnError(409, "training_job_already_started", f"training job {job_id} is already running",
                                param="job_id", hint=f"DELETE /v1/train/jobs/{job_id} stops it at the next step.")
            if job.state != QUEUED:
                raise KilnError(409, "training_job_not_cancellable", f"training job {job_id} is {job.state}",
                                param="job_id", hint="Only queued or running jobs can be cancelled.")
            self._dequeue(job)
        return {"status": "cancelled", "job_id": job_id}

    def cancel_or_delete(self, job_id: str) -> dict[str, Any]:
        """DELETE /v1/train/jobs/{id}: cancel a queued job, stop a running one at its next step
        boundary (no adapter is saved), or forget a finished one (its record file is removed)."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None:
                raise job_not_found(job_id)
            if job.state == QUEUED:
                self._dequeue(job)
                return {"status": "cancelled", "job_id": job_id, "was_in_queue": True}
            if job.state == RUNNING:
                job.cancel_requested = True
                self.store.save(job)
                return {"status": "cancelling", "job_id": job_id,
                        "note": "the job stops at its next step boundary; no adapter is saved"}
            del self._jobs[job_id]
        self._drop_checkpoints(job_id)
        removed = self.store.delete(job_id)
        return {"status": "deleted", "job_id": job_id, "removed_record_file": removed}

    def _dequeue(self, job: TrainJob) -> None:
        self._queue.remove(job.job_id)
        self._plans.pop(job.job_id, None)
        job.state, job.finished_at = CANCELLED, utc_now_rfc3339()
        self.store.save(job)
        self._drop_checkpoints(job.job_id)
        self._notify_webhook(job)
        self._notify_listeners(job)

    def _drop_checkpoints(self, job_id: str) -> None:
        if self.checkpoints is not None:
            try:
                self.checkpoints.delete(job_id)
            except OSError as e:
                log.warning("training job %s: its checkpoints were not removed: %s", job_id, e)

    # -- the worker ------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job_id = self._queue.popleft()
                job, plan = self._jobs[job_id], self._plans.pop(job_id)
                self._running = job_id
                job.state, job.started_at = RUNNING, utc_now_rfc3339()
                self.store.save(job)
            try:
                self._run_one(job, plan)
            finally:
                with self._cond:
                    self._running = None

    def _run_one(self, job: TrainJob, plan: TrainingPlan) -> None:
        t0 = time.perf_counter()
        last_save = [0.0]

        def on_update() -> None:
            now = time.monotonic()
            if now - last_save[0] >= SAVE_INTERVAL:
                last_save[0] = now
                self.store.save(job)

        extra: dict[str, Any] = {}
        if self.checkpoints is not None:
            extra["checkpointing"] = Checkpointing(self.checkpoints, self._checkpoint_every(plan),
                                                   lambda: self._pausing, lambda: self.store.save(job))
        try:
            self.run(job, plan, self.context(), on_update=on_update, should_stop=lambda: job.cancel_requested,
                     **extra)
            job.state = COMPLETED
        except Paused:
            job.state = INTERRUPTED
            job.error = (f"interrupted by a server shutdown at step {job.step}; POST /v1/train/jobs/{job.job_id}/resume "
                         "continues it")
            job.elapsed_secs = round(time.perf_counter() - t0, 3)
            self.store.save(job)
            log.info("training job %s paused at step %d (checkpoint at step %s)", job.job_id, job.step,
                     (job.checkpoint or {}).get("step"))
            return
        except Cancelled:
            job.state = CANCELLED
            log.info("training job %s cancelled at step %d", job.job_id, job.step)
        except KilnError as e:
            job.state, job.error = FAILED, e.message
            log.warning("training job %s failed: %s", job.job_id, e.message)
        except Exception as e:  # noqa: BLE001 - a job failure is recorded, never kills the worker
            job.state, job.error = FAILED, f"{type(e).__name__}: {e}"
            log.exception("training job %s failed", job.job_id)
        job.elapsed_secs = round(time.perf_counter() - t0, 3)
        job.finished_at = utc_now_rfc3339()
        post_eval = job.state == COMPLETED and plan.post_eval is not None
        if post_eval and plan.gated:
            mark_pending(job)
        self.store.save(job)
        self._drop_checkpoints(job.job_id)
        log.info("training job %s %s after %.1fs (adapter %s)", job.job_id, job.state, job.elapsed_secs,
                 job.adapter_name)
        if post_eval:
            self._start_post_eval(job, plan)
        if not (post_eval and plan.gated):
            self._notify_webhook(job)
        self._notify_listeners(job)

    def _checkpoint_every(self, plan: TrainingPlan) -> int:
        asked = plan.config.get("checkpoint_interval")
        return int(asked) if asked is not None else self.checkpoint_every

    # -- the post-training eval and its gate -----------------------------------------------------------
    def _start_post_eval(self, job: TrainJob, plan: TrainingPlan) -> None:
        assert plan.post_eval is not None
        try:
            if self.eval_link is None:
                raise KilnError(503, "eval_registry_unavailable", "this server runs no eval jobs")
            active = getattr(self.context().active, "name", None)
            # Baseline: the adapter served before this one (§8.14), else the base model.
            baseline = active if active != job.adapter_name else None
            eval_job = self.eval_link.submit(build_eval_job(plan.post_eval, job.adapter_name, job.job_id, baseline))
        except Exception as e:  # noqa: BLE001 - any failure to queue fails the gate closed
            log.warning("training job %s: post-training eval not queued: %s", job.job_id, e)
            with self._cond:
                submission_failed(job, e)
                self.store.save(job)
            if plan.gated:
                self._notify_webhook(job)
            self._notify_listeners(job)
            return
        with self._cond:
            if eval_job.job_id not in job.linked_eval_job_ids:
                job.linked_eval_job_ids.append(eval_job.job_id)
            self.store.save(job)
        log.info("training job %s: post-training eval job %s queued (baseline %s)", job.job_id, eval_job.job_id,
                 baseline or "<base>")

    def on_eval_finished(self, eval_job: EvalJob) -> None:
        """The eval manager's terminal-state listener (on the event loop): resolve off the loop."""
        if eval_job.submission_kind != "post_training" or not eval_job.source_training_job_id:
            return
        with self._cond:
            job = self._jobs.get(eval_job.source_training_job_id)
        if job is None:
            return
        threading.Thread(target=self.resolve_post_eval, args=(job, eval_job), name="kiln-train-gate",
                         daemon=True).start()

    def resolve_post_eval(self, job: TrainJob, eval_job: EvalJob) -> None:
        """Record the eval's outcome on its training job: the gate (and its action) or a report."""
        gated = is_gated(job)
        if gated and job.gate_outcome != PENDING:
            return  # already resolved (or failed closed at startup)
        if gated:
            resolve_gate(job, eval_job, self.context)
        else:
            report(job, eval_job)
        with self._cond:
            if eval_job.job_id not in job.linked_eval_job_ids:
                job.linked_eval_job_ids.append(eval_job.job_id)
            if self._jobs.get(job.job_id) is job:
                self.store.save(job)
        log.info("training job %s: post-training eval %s -> %s", job.job_id, eval_job.job_id,
                 job.gate_outcome or "report")
        if gated:
            self._notify_webhook(job)
        self._notify_listeners(job)

    def _notify_listeners(self, job: TrainJob) -> None:
        for listener in list(self.listeners):
            try:
                listener(job)
            except Exception:  # noqa: BLE001
                log.exception("a training-job listener failed on %s", job.job_id)

    def _notify_webhook(self, job: TrainJob) -> None:
        url = job.webhook_url or self.webhook_url
        if not url:
            return
        payload = webhook_payload(job)

        def send() -> None:
            job.webhook = self.send_webhook(url, payload)
            with self._cond:
                if self._jobs.get(job.job_id) is job:  # not forgotten meanwhile: do not resurrect its file
                    self.store.save(job)

        # Fire and forget: a slow receiver must not hold up the next job.
        threading.Thread(target=send, name="kiln-train-webhook", daemon=True).start()
