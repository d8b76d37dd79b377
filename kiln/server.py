"""The composition root: `build_server(settings)` builds every long-lived service of a server once,
eagerly, in dependency order, and the app whose routers read them.

The order, each step using only what the steps before it built:
  lifecycle (draining, shutdown hooks) -> metrics -> adapters (store, the active adapter, the
  composition cache) -> datasets -> judgments -> eval suites -> eval jobs (suites, adapters, the
  engine through a generator factory) -> training (adapters, eval jobs: post-training gates queue
  eval jobs and hear when they end) -> corrections (training: a job's end marks its corrections
  trained) -> the recorder (recent requests, the request log; the metrics listen to it) -> the traffic
  observer (metrics, recorder, access line: kiln.api.observer) -> teachers -> replicas (adapters, eval
  jobs: evals fan out over them; training: publish on a passed gate).
Shutdown and drain hooks are registered here, next to the service they stop. Routers never build a
service: they read `request.app.state.kiln` (kiln.api.state.ServerState), whatever order they mount in.
The engine comes later (`kiln serve` loads it in the background while /health answers 503) and is
published with `state.engine = engine`, which registers the traffic observer in its observers;
services that need it reach it through `require_engine`.

Imports: api (the app, the state, metrics, lifecycle), and the services' packages below it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import disable_created_metrics

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.compose import CompositionCache
from kiln.adapters.importing import import_lora_modules
from kiln.adapters.store import AdapterStore
from kiln.api.app import create_app
from kiln.api.lifecycle import startup_sweep
from kiln.api.metrics import KilnMetrics
from kiln.api.observer import TrafficObserver
from kiln.api.services import Services
from kiln.api.shutdown import Lifecycle
from kiln.api.state import ServerState
from kiln.config import Settings
from kiln.data.datasets import DatasetStore
from kiln.data.judgments import JudgmentStore
from kiln.engine.build import build_engine
from kiln.engine.eval_generator import LocalEngineGenerator
from kiln.engine.serving import Engine
from kiln.evals.generator import Generator
from kiln.evals.intake import IntakeContext
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.job_store import EvalJobStore
from kiln.evals.job_store import job_root as eval_job_root
from kiln.evals.suite_store import SuiteStore, suite_root
from kiln.replicas.evals import ReplicaFanOut, placement_root
from kiln.replicas.service import ReplicaService, replica_root
from kiln.replicas.wiring import local_model, publish_on_pass
from kiln.store.sweep import LiveLock
from kiln.traffic.records import CompletionRecorder, RecentRequests
from kiln.traffic.request_log import RequestLog
from kiln.train.checkpoint import CheckpointStore, checkpoint_root
from kiln.train.corrections import CorrectionStore, follow_training
from kiln.train.eval_link import EvalLink
from kiln.train.executor import JobContext
from kiln.train.job_store import TrainJobStore
from kiln.train.job_store import job_root as train_job_root
from kiln.train.manager import TrainingManager
from kiln.train.submission import resume_interrupted
from kiln.train.teachers import TeacherStore


@dataclass
class Server:
    """A built server: the state its routers read and the app that mounts them."""

    state: ServerState
    app: FastAPI

    @property
    def services(self) -> Services:
        return self.state.services

    def sweep_stores(self) -> tuple[dict[str, list[str]], list[LiveLock]]:
        """Before the first request: every store settles what killed writers left (kiln.api.lifecycle);
        returns (actions per store, the locks to hold while the server lives)."""
        return startup_sweep(self.state)

    def import_lora_modules(self, specs: list[str]) -> list[str]:
        """`--lora-modules NAME=PATH ...` into the adapter store; one line to log per adapter."""
        return import_lora_modules(self.services.adapter_store, specs)

    def load_engine(self) -> None:
        """Load the model (minutes for a large one) and publish it."""
        self.publish(build_engine(self.state.settings))

    def publish(self, engine: Engine) -> None:
        """Serve requests with `engine`: the stored adapters and the default adapter the last process
        chose are attached before it is published (once /health says ready, requests get that adapter
        and its state file is not mid-write); then interrupted training resumes when configured."""
        self.state.attach_adapters(engine)
        self.state.engine = engine
        s = self.services
        if s.training.auto_resume:
            resume_interrupted(s.training, engine, s.adapter_store, s.datasets, s.eval_suites, s.judgments,
                               s.teachers)

    def close(self) -> None:
        """After the last request: the request log writes what is queued, the engine stops."""
        self.services.recorder.close()
        if self.state.engine is not None:
            self.state.engine.shutdown()


def build_server(settings: Settings, *, routers: Sequence[str] | None = None,
                 adapter_store: AdapterStore | None = None) -> Server:
    """Every service, then the app; `routers` (module names, default every router) mounts a subset, as
    tests do; `adapter_store` replaces the store over `settings.adapter_dir` (a test's own limits)."""
    state = build_state(settings, adapter_store=adapter_store)
    return Server(state, create_app(settings, state, routers))


def build_state(settings: Settings, *, adapter_store: AdapterStore | None = None) -> ServerState:
    """The services without an app (what a test or a command that serves nothing needs)."""
    return ServerState(settings, Lifecycle(settings.server.shutdown_timeout_secs),
                       lambda state: _services(state, adapter_store))


def _services(state: ServerState, adapter_store: AdapterStore | None) -> Services:
    settings, lifecycle = state.settings, state.lifecycle
    data_dir = Path(settings.data.data_dir)
    # `*_created` timestamp series double the exposition and no dashboard reads them
    disable_created_metrics()
    metrics = KilnMetrics(state)
    adapters = adapter_store if adapter_store is not None else AdapterStore(settings.adapter_dir)
    active = ActiveAdapter(adapters)
    datasets = DatasetStore(data_dir / "datasets")
    suites = SuiteStore(suite_root(settings.data.data_dir))
    eval_jobs = _eval_jobs(state, suites, adapters)
    training = _training(state, adapters, active, eval_jobs)
    # Shutdown: the running job stops at its next batch boundary (checkpointed, interrupted) as soon as
    # draining starts; the hook waits for that.
    lifecycle.on_drain.append(training.request_pause)
    lifecycle.add_shutdown_hook("training", training.pause_for_shutdown)
    corrections = CorrectionStore(data_dir / "corrections")
    follow_training(corrections, training)
    recorder = _recorder(settings, listeners=[metrics.observe_record])
    # Graceful shutdown: once requests drained, what they queued for the request log is written.
    lifecycle.add_shutdown_hook("request_log", lambda seconds_left: recorder.flush(max(seconds_left, 10.0)))
    # The one observer of served traffic; publishing an engine registers it (ServerState.engine).
    traffic = TrafficObserver(settings.server, metrics, recorder, served_model=lambda: _served_model(state))
    replicas = _replicas(state, adapters, eval_jobs, training)
    return Services(metrics=metrics, adapter_store=adapters, adapters_active=active,
                    adapter_compose_cache=CompositionCache(adapters), datasets=datasets,
                    judgments=JudgmentStore(data_dir / "judgments"), eval_suites=suites, eval_jobs=eval_jobs,
                    training=training, recorder=recorder, traffic=traffic, corrections=corrections,
                    teachers=TeacherStore(data_dir / "teachers"), replicas=replicas)


def _eval_jobs(state: ServerState, suites: SuiteStore, adapters: AdapterStore) -> EvalJobManager:
    settings = state.settings
    ctx = IntakeContext(suites=suites, resolve_target=_target_resolver(adapters),
                           active_adapter=lambda: state.services.active_adapter_name())
    manager = EvalJobManager(EvalJobStore(eval_job_root(settings.data.data_dir)), ctx, _generator_factory(state),
                             max_queued_jobs=settings.eval.max_queued_jobs,
                             max_tracked_jobs=settings.eval.max_tracked_jobs)
    manager.load_archived()
    return manager


def _training(state: ServerState, adapters: AdapterStore, active: ActiveAdapter,
              eval_jobs: EvalJobManager) -> TrainingManager:
    settings, training = state.settings, state.settings.training

    def context() -> JobContext:
        return JobContext(state.require_engine(), adapters, active)

    manager = TrainingManager(TrainJobStore(train_job_root(settings.data.data_dir)), context,
                              max_queued_jobs=training.max_queued_jobs, max_tracked_jobs=training.max_tracked_jobs,
                              webhook_url=training.webhook_url, eval_link=EvalLink(eval_jobs),
                              checkpoints=CheckpointStore(checkpoint_root(settings.data.data_dir)),
                              checkpoint_every=training.checkpoint_every_steps, auto_resume=training.auto_resume)
    manager.load_archived()
    eval_jobs.listeners.append(manager.on_eval_finished)
    return manager


def _replicas(state: ServerState, adapters: AdapterStore, eval_jobs: EvalJobManager,
              training: TrainingManager) -> ReplicaService:
    """Other servers: their health polled from now on, evals that name them fanned out over them, and a
    training job's adapter published to them when its gate passes with `publish_on_pass`."""
    settings = state.settings
    service = ReplicaService(replica_root(settings.data.data_dir), settings.replicas,
                             lambda: local_model(state.engine))
    service.health.start()
    state.lifecycle.on_drain.append(service.health.stop)
    eval_jobs.fanout = ReplicaFanOut(service, placement_root(settings.data.data_dir),
                                     local_capacity=settings.engine.max_num_seqs, revision=adapters.content_hash,
                                     local_model_name=lambda: local_model(state.engine).name)

    def publish_after_gate(job: Any) -> None:
        publish_on_pass(service, adapters, settings, job)

    training.listeners.append(publish_after_gate)
    return service


def _served_model(state: ServerState) -> str:
    engine = state.engine
    return engine.info.served_model_id if engine is not None else ""


def _recorder(settings: Settings, *, listeners: list[Callable[[Any], None]]) -> CompletionRecorder:
    """The ring of recent requests, and the request log when `[request_log] enabled`."""
    rl = settings.request_log
    request_log = None
    if rl.enabled:
        request_log = RequestLog(settings.request_log_dir, max_file_bytes=rl.max_file_bytes,
                                 max_total_bytes=rl.max_total_bytes, compress=rl.compress,
                                 max_row_bytes=rl.max_capture_bytes, queue_rows=rl.queue_rows)
    ring = RecentRequests(settings.stats.recent_requests, preview_chars=settings.stats.preview_chars)
    return CompletionRecorder(ring, request_log, listeners=listeners)


def _target_resolver(store: AdapterStore) -> Callable[[str | None], dict[str, Any]]:
    def resolve(adapter: str | None) -> dict[str, Any]:
        if adapter is None:
            return {}
        store.require(adapter, param="adapter")  # 400 for a bad name, 404 for an unknown one
        return {"adapter": adapter, "adapter_content_sha256": store.content_hash(adapter)}

    return resolve


def _generator_factory(state: ServerState) -> Callable[[], Generator]:
    """The eval jobs' generator over the published engine (503 while it loads), one per engine."""
    cache: dict[int, Generator] = {}

    def generator() -> Generator:
        engine = state.require_engine()
        if id(engine) not in cache:
            cache.clear()
            cache[id(engine)] = LocalEngineGenerator(engine, state.settings.server)
        return cache[id(engine)]

    return generator

