"""The server's long-lived services, typed, and how each is built.

`ServerState.services` is one `Services`. Each `ensure_*` builds its service once, building what it
depends on first, so the order is explicit: adapters -> datasets -> judgments; suites -> eval jobs
(adapters, suites, the engine through a generator factory) -> training (adapters, eval jobs). A
router's `init(state)` ensures what its routes read; a test may set a field before `create_app`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.adapters.active import ActiveAdapter
    from kiln.adapters.compose import CompositionCache
    from kiln.adapters.store import AdapterStore
    from kiln.api.metrics import KilnMetrics
    from kiln.api.state import ServerState
    from kiln.data.datasets import DatasetStore
    from kiln.data.judgments import JudgmentStore
    from kiln.engine.records import CompletionRecorder
    from kiln.evals.generator import Generator
    from kiln.evals.job_manager import EvalJobManager
    from kiln.evals.suite_store import SuiteStore
    from kiln.replicas.service import ReplicaService
    from kiln.train.corrections import CorrectionStore
    from kiln.train.executor import JobContext
    from kiln.train.manager import TrainingManager
    from kiln.train.teachers import TeacherStore


@dataclass
class Services:
    metrics: KilnMetrics | None = None
    adapter_store: AdapterStore | None = None
    adapters_active: ActiveAdapter | None = None          # the engine hooks its swap into .callbacks
    adapter_compose_cache: CompositionCache | None = None  # for chat `adapters: [{name, scale}]`
    datasets: DatasetStore | None = None
    judgments: JudgmentStore | None = None
    eval_suites: SuiteStore | None = None
    eval_jobs: EvalJobManager | None = None
    training: TrainingManager | None = None
    recorder: CompletionRecorder | None = None       # recent requests, the request log (kiln.engine.records)
    corrections: CorrectionStore | None = None
    replicas: ReplicaService | None = None           # built by kiln.api.routers.replicas.ensure_replicas
    teachers: TeacherStore | None = None

    def active_adapter_name(self) -> str | None:
        return getattr(self.adapters_active, "name", None) or None


def ensure_metrics(state: ServerState) -> KilnMetrics:
    if state.services.metrics is None:
        from kiln.api.metrics import KilnMetrics

        state.services.metrics = KilnMetrics(state)
    return state.services.metrics


def ensure_adapters(state: ServerState) -> AdapterStore:
    from kiln.adapters.active import ActiveAdapter
    from kiln.adapters.compose import CompositionCache
    from kiln.adapters.store import AdapterStore

    s = state.services
    if s.adapter_store is None:
        s.adapter_store = AdapterStore(state.settings.adapter_dir)
    if s.adapters_active is None:
        s.adapters_active = ActiveAdapter(s.adapter_store)
    if s.adapter_compose_cache is None:
        s.adapter_compose_cache = CompositionCache(s.adapter_store)
    return s.adapter_store


def ensure_datasets(state: ServerState) -> DatasetStore:
    from kiln.data.datasets import DatasetStore

    if state.services.datasets is None:
        state.services.datasets = DatasetStore(Path(state.settings.data.data_dir) / "datasets")
    return state.services.datasets


def ensure_judgments(state: ServerState) -> JudgmentStore:
    from kiln.data.judgments import JudgmentStore

    ensure_datasets(state)  # compile writes a dataset
    if state.services.judgments is None:
        state.services.judgments = JudgmentStore(Path(state.settings.data.data_dir) / "judgments")
    return state.services.judgments


def ensure_teachers(state: ServerState) -> TeacherStore:
    from kiln.train.teachers import TeacherStore

    if state.services.teachers is None:
        state.services.teachers = TeacherStore(Path(state.settings.data.data_dir) / "teachers")
    return state.services.teachers


def ensure_suites(state: ServerState) -> SuiteStore:
    from kiln.evals.suite_store import SuiteStore, suite_root

    if state.services.eval_suites is None:
        state.services.eval_suites = SuiteStore(suite_root(state.settings.data.data_dir))
    return state.services.eval_suites


def ensure_eval_jobs(state: ServerState) -> EvalJobManager:
    from kiln.evals.admission import AdmissionContext
    from kiln.evals.job_manager import EvalJobManager
    from kiln.evals.job_store import EvalJobStore, job_root

    if state.services.eval_jobs is None:
        ctx = AdmissionContext(suites=ensure_suites(state), resolve_target=_target_resolver(state),
                               active_adapter=state.services.active_adapter_name)
        manager = EvalJobManager(EvalJobStore(job_root(state.settings.data.data_dir)), ctx,
                                 _generator_factory(state), max_queued_jobs=state.settings.eval.max_queued_jobs,
                                 max_tracked_jobs=state.settings.eval.max_tracked_jobs)
        manager.load_archived()
        state.services.eval_jobs = manager
    return state.services.eval_jobs


def ensure_training(state: ServerState) -> TrainingManager:
    """After the eval jobs when those exist: post-training gates queue eval jobs and wait for their end."""
    from kiln.train.checkpoint import CheckpointStore, checkpoint_root
    from kiln.train.eval_link import EvalLink
    from kiln.train.job_store import TrainJobStore, job_root
    from kiln.train.manager import TrainingManager

    if state.services.training is None:
        ensure_adapters(state)
        training = state.settings.training
        eval_jobs = state.services.eval_jobs
        manager = TrainingManager(TrainJobStore(job_root(state.settings.data.data_dir)), _job_context(state),
                                  max_queued_jobs=training.max_queued_jobs, max_tracked_jobs=training.max_tracked_jobs,
                                  webhook_url=training.webhook_url,
                                  eval_link=EvalLink(eval_jobs) if eval_jobs is not None else None,
                                  checkpoints=CheckpointStore(checkpoint_root(state.settings.data.data_dir)),
                                  checkpoint_every=training.checkpoint_every_steps,
                                  auto_resume=training.auto_resume)
        manager.load_archived()
        if eval_jobs is not None:
            eval_jobs.listeners.append(manager.on_eval_finished)
        # Shutdown: the running job stops at its next batch boundary (checkpointed, interrupted) as soon
        # as draining starts; the hook waits for that.
        state.lifecycle.on_drain.append(manager.request_pause)
        state.lifecycle.add_shutdown_hook("training", manager.pause_for_shutdown)
        state.services.training = manager
    return state.services.training


def ensure_recorder(state: ServerState) -> CompletionRecorder:
    """The ring of recent requests, the request log when `[request_log] enabled`, and the metrics."""
    from kiln.engine.records import CompletionRecorder, RecentRequests
    from kiln.store.request_log import RequestLog

    s = state.services
    if s.recorder is None:
        settings = state.settings
        rl = settings.request_log
        request_log = None
        if rl.enabled:
            request_log = RequestLog(settings.request_log_dir, max_file_bytes=rl.max_file_bytes,
                                     max_total_bytes=rl.max_total_bytes, compress=rl.compress,
                                     max_row_bytes=rl.max_capture_bytes, queue_rows=rl.queue_rows)
        ring = RecentRequests(settings.stats.recent_requests, preview_chars=settings.stats.preview_chars)
        s.recorder = CompletionRecorder(ring, request_log,
                                        listeners=[s.metrics.observe_record] if s.metrics is not None else [])
        # Graceful shutdown: once requests drained, what they queued for the request log is written.
        recorder = s.recorder
        state.lifecycle.add_shutdown_hook("request_log", lambda seconds_left: recorder.flush(max(seconds_left, 10.0)))
    return s.recorder


def ensure_corrections(state: ServerState) -> CorrectionStore:
    """After training when that exists: a corrections job's end marks its corrections trained."""
    from kiln.train.corrections import CorrectionStore, follow_training

    s = state.services
    if s.corrections is None:
        s.corrections = CorrectionStore(Path(state.settings.data.data_dir) / "corrections")
        if s.training is not None:
            follow_training(s.corrections, s.training)
    return s.corrections


def _target_resolver(state: ServerState):
    from kiln.evals.admission import base_target_only

    def resolve(adapter: str | None) -> dict[str, Any]:
        store = state.services.adapter_store
        if adapter is None or store is None:
            return base_target_only(adapter)
        store.require(adapter, param="adapter")  # 400 for a bad name, 404 for an unknown one
        return {"adapter": adapter, "adapter_content_sha256": store.content_hash(adapter)}

    return resolve


def _generator_factory(state: ServerState):
    cache: dict[int, Generator] = {}

    def generator() -> Generator:
        from kiln.engine.eval_generator import LocalEngineGenerator

        engine = state.require_engine()
        if id(engine) not in cache:
            cache.clear()
            cache[id(engine)] = LocalEngineGenerator(engine, state.settings.server)
        return cache[id(engine)]

    return generator


def _job_context(state: ServerState):
    def context() -> JobContext:
        from kiln.train.executor import JobContext

        return JobContext(state.require_engine(), state.services.adapter_store, state.services.adapters_active)

    return context
