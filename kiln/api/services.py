"""The server's long-lived services, typed: what `ServerState.services` holds.

Built once, eagerly, in dependency order, by `kiln.server.build_server` (the one place that assembles
a server); routers only read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.adapters.active import ActiveAdapter
from kiln.adapters.compose import CompositionCache
from kiln.adapters.store import AdapterStore
from kiln.data.datasets import DatasetStore
from kiln.data.judgments import JudgmentStore
from kiln.evals.job_manager import EvalJobManager
from kiln.evals.suite_store import SuiteStore
from kiln.replicas.service import ReplicaService
from kiln.traffic.records import CompletionRecorder
from kiln.train.corrections import CorrectionStore
from kiln.train.manager import TrainingManager
from kiln.train.teachers import TeacherStore

if TYPE_CHECKING:  # kiln.api.metrics reads ServerState, which holds these services
    from kiln.api.metrics import KilnMetrics
    from kiln.api.observer import TrafficObserver


@dataclass
class Services:
    metrics: KilnMetrics
    adapter_store: AdapterStore
    adapters_active: ActiveAdapter          # the engine hooks its swap into .callbacks
    adapter_compose_cache: CompositionCache  # for chat `adapters: [{name, scale}]`
    datasets: DatasetStore
    judgments: JudgmentStore
    eval_suites: SuiteStore
    eval_jobs: EvalJobManager
    training: TrainingManager
    recorder: CompletionRecorder             # recent requests, the request log (kiln.traffic.records)
    traffic: TrafficObserver                 # the one observer of served and refused requests
    corrections: CorrectionStore
    teachers: TeacherStore                   # who OPD and distillation learn from (kiln.train.teachers)
    replicas: ReplicaService                 # other servers: health, publishing, eval fan-out (kiln.replicas)

    def active_adapter_name(self) -> str | None:
        return getattr(self.adapters_active, "name", None) or None
