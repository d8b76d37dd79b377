"""The eval job queue: queue caps, one background worker, cancel/delete, archives (§8.10, §8.11).

Jobs run one at a time on the server's event loop (the worker is an asyncio task started by the
first request that needs it); inside a job, a run sends all of its completions to the generator at
once. Terminal jobs are archived; a job writes a "running" marker when it starts so a crash leaves
evidence that reloads as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kiln.errors import KilnError
from kiln.evals.compare import adapter_label
from kiln.evals.generator import Generator
from kiln.evals.intake import IntakeContext, job_for_run, judge_targets_for
from kiln.evals.job_store import EvalJobStore
from kiln.evals.jobs import EvalJob
from kiln.evals.replay import replay_verdict
from kiln.evals.requests import parse_run_request
from kiln.evals.runner import RunPlan, run_suite
from kiln.store.clock import utc_now_rfc3339

log = logging.getLogger("kiln.evals")

RETRY_AFTER = {"Retry-After": "15"}
CANCELLING_NOTE = "running job will exit at the next example boundary"
SHUTDOWN_ERROR = "the server shut down while this job was running; runs that had finished are kept"


def job_not_found(job_id: str) -> KilnError:
    return KilnError(404, "eval_job_not_found", f"Eval job {job_id!r} not found", param="job_id",
                     hint="List jobs with GET /v1/eval/jobs.")


class EvalJobManager:
    def __init__(self, store: EvalJobStore, ctx: IntakeContext, generator: Callable[[], Generator], *,
                 max_queued_jobs: int = 32, max_tracked_jobs: int = 1024) -> None:
        self.store = store
        self.ctx = ctx
        self.generator_factory = generator  # raises KilnError while no model can generate
        self.max_queued_jobs = max_queued_jobs
        self.max_tracked_jobs = max_tracked_jobs
        self.jobs: dict[str, EvalJob] = {}
        self._queue: deque[str] = deque()
        self._sequence = 0
        self._active: EvalJob | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called on the event loop with every job that reaches a terminal state (post-training gates).
        self.listeners: list[Callable[[EvalJob], None]] = []
        # Set by the replica service: admits `replicas` on a run and wraps the local generator for a job
        # that names them (kiln.replicas.evals). None: no run may name replicas.
        self.fanout: FanOut | None = None

    def sweep(self) -> list[str]:
        """Startup sweep of the job archives (temp files of interrupted writes)."""
        return self.store.sweep()

    # -- startup ------------------------------------------------------------------------------------
    def load_archived(self) -> int:
        for job in self.store.load_all(keep=self.max_tracked_jobs):
            self.jobs[job.job_id] = job
            self._sequence = max(self._sequence, job.sequence)
        return len(self.jobs)

    def start_worker(self) -> None:
        """Start the worker on the running loop (again, if an earlier loop went away)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop, self._wake = loop, asyncio.Event()
        self._task = loop.create_task(self._worker(), name="kiln-eval-worker")
        if self._queue:
            self._wake.set()

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- intake -------------------------------------------------------------------------------------
    def generator(self) -> Generator:
        return self.generator_factory()

    def submit(self, job: EvalJob | Mapping[str, Any]) -> EvalJob:
        """Queue a job; a mapping is read as an EvalRunRequest body (how other routers queue runs)."""
        if not isinstance(job, EvalJob):
            job = job_for_run(self.ctx, parse_run_request(dict(job)))
        if len(self._queue) >= self.max_queued_jobs:
            raise KilnError(503, "eval_queue_full", f"the eval queue is full ({self.max_queued_jobs} jobs waiting)",
                            hint="Retry after the running jobs finish, or cancel queued ones.", headers=RETRY_AFTER)
        if len(self.jobs) >= self.max_tracked_jobs:
            raise KilnError(503, "eval_tracked_full",
                            f"the server tracks {self.max_tracked_jobs} eval jobs, its limit",
                            hint="Delete finished jobs with DELETE /v1/eval/jobs/{id}.", headers=RETRY_AFTER)
        self._sequence += 1
        job.sequence = self._sequence
        # Written before the id is answered: an acknowledged job survives a crash (it comes back failed,
        # "interrupted", rather than vanishing).
        self.store.save(job)
        self.jobs[job.job_id] = job
        self._queue.append(job.job_id)
        log.info("queued %s eval job %s: suite %s (%d examples) on %s", job.submission_kind, job.job_id,
                 job.suite.name, len(job.suite.examples), ", ".join(adapter_label(a) for a in job.adapters))
        if self._wake is not None:
            self._wake.set()
        with contextlib.suppress(RuntimeError):  # no running loop: the next request starts the worker
            self.start_worker()
        return job

    # -- queries ------------------------------------------------------------------------------------
    def get(self, job_id: str) -> EvalJob:
        job = self.jobs.get(job_id)
        if job is None:
            raise job_not_found(job_id)
        return job

    def all_jobs(self) -> list[EvalJob]:
        """Newest submission first."""
        return sorted(self.jobs.values(), key=lambda j: (j.submitted_at, j.sequence), reverse=True)

    def queue_position(self, job_id: str) -> int | None:
        return self._queue.index(job_id) + 1 if job_id in self._queue else None

    # -- cancel / delete ----------------------------------------------------------------------------
    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self.get(job_id)
        if job is self._active:
            # Running (or already cancelling): the worker stops at the next example boundary.
            job.state = "cancelled"
            if self._stop is not None:
                self._stop.set()
            return {"status": "cancelling", "job_id": job_id, "note": CANCELLING_NOTE}
        if job.state == "queued":
            self._queue.remove(job_id)
            job.state, job.finished_at = "cancelled", utc_now_rfc3339()
            self.store.save(job)
            self._finished(job)
            return {"status": "cancelled", "job_id": job_id, "was_in_queue": True}
        del self.jobs[job_id]
        return {"status": "deleted", "job_id": job_id, "removed_archive_file": self.store.delete(job_id)}

    # -- the worker ---------------------------------------------------------------------------------
    async def _worker(self) -> None:
        assert self._wake is not None
        while True:
            while not self._queue:
                await self._wake.wait()
                self._wake.clear()
            job = self.jobs.get(self._queue.popleft())
            if job is not None and job.state == "queued":
                await self.run_job(job)

    async def run_job(self, job: EvalJob) -> None:
        """Run every adapter of the job in order; never raises except when the loop cancels it."""
        self._active, self._stop = job, asyncio.Event()
        job.state, job.started_at = "running", utc_now_rfc3339()
        self._save(job)  # the running marker
        try:
            await self._run_adapters(job, self._stop)
            if job.state == "running":
                job.state = "completed"
        except asyncio.CancelledError:
            job.state, job.error = "failed", SHUTDOWN_ERROR
            raise
        except KilnError as e:
            job.state, job.error = "failed", e.message
        except Exception as e:  # noqa: BLE001 - a job failure must not take the worker down
            log.exception("eval job %s failed", job.job_id)
            job.state, job.error = "failed", f"{type(e).__name__}: {e}"
        finally:
            job.finished_at = utc_now_rfc3339()
            if job.replay_expectation is not None:
                job.replay_verdict = self._verdict(job)
            self._save(job)
            self._active = self._stop = None
            log.info("%s", job_summary(job))
            self._finished(job)

    def admit_replicas(self, job: EvalJob, replicas: Any) -> None:
        """Let `job` fan out over `replicas` ("all" or names), checked now: a 4xx when it may not."""
        if self.fanout is None:
            raise KilnError(400, "eval_invalid_request", "Invalid eval request: replicas: this server has no "
                            "replica service", param="replicas")
        job.replicas = self.fanout.admit(replicas, job)

    async def _run_adapters(self, job: EvalJob, stop: asyncio.Event) -> None:
        generator = self.generator_factory()
        if job.replicas is not None and self.fanout is not None:
            generator = self.fanout.generator(job, generator)
        try:
            await self._run_on(job, generator, stop)
        finally:
            close = getattr(generator, "aclose", None)
            if job.replicas is not None and close is not None:
                await close()

    async def _run_on(self, job: EvalJob, generator: Generator, stop: asyncio.Event) -> None:
        identity = await generator.identity()
        job.execution_provenance = identity.execution_provenance
        job.base_weight_manifest = identity.base_weight_manifest
        judges = judge_targets_for(self.ctx, job.suite, job.generation_override)
        for adapter in job.adapters:
            if stop.is_set():
                return
            plan = RunPlan(suite=job.suite, effective_seed=job.effective_seed, adapter=adapter,
                           model_target=self.ctx.resolve_target(adapter), generation_override=job.generation_override,
                           judge_targets=judges)
            job.progress = None
            result = await run_suite(plan, generator, identity, stop=stop,
                                     on_progress=lambda p: setattr(job, "progress", p))
            job.runs.append(result.suite_result)
            if result.cancelled:
                return
            self._save(job)

    def _verdict(self, job: EvalJob) -> dict[str, Any]:
        assert job.replay_expectation is not None
        record = job.runs[0].get("replay_record") if job.runs else None
        error = None
        if job.state != "completed":
            error = f"the replay job ended {job.state}" + (f": {job.error}" if job.error else "")
        return replay_verdict(job.replay_expectation, record, error=error)

    def _finished(self, job: EvalJob) -> None:
        for listener in list(self.listeners):
            try:
                listener(job)
            except Exception:  # noqa: BLE001 - a listener's bug must not take the worker down
                log.exception("eval job %s: terminal-state listener failed", job.job_id)

    def _save(self, job: EvalJob) -> None:
        if self.jobs.get(job.job_id) is not job:
            return  # deleted meanwhile: do not resurrect its archive
        try:
            self.store.save(job)
        except OSError as e:
            log.error("cannot archive eval job %s: %s", job.job_id, e)


class FanOut(Protocol):
    def admit(self, replicas: Any, job: EvalJob) -> list[str]: ...

    def generator(self, job: EvalJob, local: Generator) -> Generator: ...

    def placement(self, job_id: str) -> dict[str, Any] | None: ...


def job_summary(job: EvalJob) -> str:
    """The log line of a finished job: its state and each run's accuracy (`... completed: <base> 75.0%, v2 100.0%`)."""
    runs = ", ".join(f"{adapter_label(r.get('adapter'))} {100 * r['metrics']['accuracy']:.1f}%"
                     f" of {r['metrics']['num_examples']}" for r in job.runs)
    line = f"eval job {job.job_id} ({job.suite.name}) {job.state}" + (f": {runs}" if runs else "")
    if job.error:
        line += f" - {job.error}"
    if job.replay_verdict:
        line += f"; replay {job.replay_verdict.get('status')}"
    return line
