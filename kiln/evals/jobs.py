"""An eval job: what was asked, where it is in its lifecycle, and its wire and archive forms (§8.10).

States: queued -> running -> completed | failed | cancelled. A job holds one SuiteResult per
finished adapter run. `info()` is the EvalJobInfo list view, `result()` the EvalResult; the archive
form adds what a restart needs to rebuild the job (the suite, the override, the targets).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.evals.generation import GenerationParams
from kiln.evals.runner import RunProgress
from kiln.evals.seeds import SEED_DERIVATION
from kiln.evals.suite import EvalSuite, parse_suite
from kiln.store.clock import utc_now_rfc3339

JobState = Literal["queued", "running", "completed", "failed", "cancelled"]
SubmissionKind = Literal["on_demand", "post_training", "compare"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
SCHEMA_VERSION = 2
ARCHIVE_TYPE = "kiln.eval-job-archive.v1"


def new_job_id() -> str:
    return "eval-" + secrets.token_hex(8)


@dataclass
class EvalJob:
    job_id: str
    suite: EvalSuite
    adapters: list[str | None]  # one run per entry, in order; None = base model
    submission_kind: SubmissionKind
    effective_seed: int
    generation_override: GenerationParams | None = None
    submitted_at: str = field(default_factory=utc_now_rfc3339)
    state: JobState = "queued"
    started_at: str | None = None
    finished_at: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    progress: RunProgress | None = None
    error: str | None = None
    replay_expectation: dict[str, Any] | None = None
    replay_verdict: dict[str, Any] | None = None
    # Replicas the generation fans out over besides the local engine (None: the local engine only).
    # Not part of the job's wire objects or its archive: kept beside it (kiln.evals.fanout).
    replicas: list[str] | None = None
    execution_provenance: dict[str, Any] | None = None
    base_weight_manifest: dict[str, Any] | None = None
    # Post-training jobs (§8.14): the training job that queued this one and, when gated, its PostEvalGate.
    source_training_job_id: str | None = None
    post_eval_gate: dict[str, Any] | None = None
    # Orders jobs submitted within the same microsecond.
    sequence: int = 0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def current_progress(self) -> RunProgress:
        if self.progress is not None:
            return self.progress
        return RunProgress(0, len(self.suite.examples), 0.0, 0.0)

    def headline_accuracy(self) -> float | None:
        return self.runs[-1]["metrics"]["accuracy"] if self.runs else None

    # -- wire ---------------------------------------------------------------------------------------
    def _provenance(self, out: dict[str, Any]) -> None:
        if self.base_weight_manifest is not None:
            out["base_weight_shard_manifest"] = self.base_weight_manifest
        if self.execution_provenance is not None:
            out["execution_provenance"] = self.execution_provenance

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "job_id": self.job_id,
                               "suite_name": self.suite.name, "adapters": list(self.adapters),
                               "submission_kind": self.submission_kind}
        self._provenance(out)
        out.update(
            effective_seed=str(self.effective_seed),
            state=self.state,
            progress=self.current_progress().to_wire(),
            finished_runs=list(self.runs),
            headline_accuracy=self.headline_accuracy(),
            error=self.error,
            source_training_job_id=self.source_training_job_id,
            submitted_at_iso=self.submitted_at,
            started_at_iso=self.started_at,
            finished_at_iso=self.finished_at,
        )
        if self.post_eval_gate is not None:
            out["post_eval_gate"] = self.post_eval_gate
        if self.replay_expectation is not None:
            out["replay_expectation"] = self.replay_expectation
        if self.replay_verdict is not None:
            out["replay_verdict"] = self.replay_verdict
        return out

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "job_id": self.job_id, "state": self.state}
        self._provenance(out)
        out["effective_seed"] = str(self.effective_seed)
        out["seed_derivation"] = SEED_DERIVATION
        if self.replay_expectation is not None:
            out["replay_expectation"] = self.replay_expectation
        if self.replay_verdict is not None:
            out["replay_verdict"] = self.replay_verdict
        out["runs"] = list(self.runs)
        if not self.terminal:
            out["progress"] = self.current_progress().to_wire()
        if self.state == "failed" and self.error is not None:
            out["error"] = self.error
        return out

    # -- archive ------------------------------------------------------------------------------------
    def to_archive(self) -> dict[str, Any]:
        return {
            "archive_type": ARCHIVE_TYPE,
            "sequence": self.sequence,
            "suite": self.suite.to_json(),
            "generation_override": self.generation_override.to_json() if self.generation_override else None,
            "info": self.info(),
            "result": self.result(),
        }

    @classmethod
    def from_archive(cls, data: dict[str, Any]) -> EvalJob:
        """Rebuild a job; raises KeyError/ValueError/KilnError for a file that is not a valid archive."""
        if data.get("archive_type") != ARCHIVE_TYPE:
            raise ValueError(f"not a {ARCHIVE_TYPE} file")
        info, result = data["info"], data["result"]
        if info.get("schema_version") != SCHEMA_VERSION or result.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("legacy multi-completion results are ambiguous and must be rerun")
        override = data.get("generation_override")
        progress = info.get("progress")
        return cls(
            job_id=info["job_id"], suite=parse_suite(data["suite"]), adapters=list(info["adapters"]),
            submission_kind=info["submission_kind"], effective_seed=int(info["effective_seed"]),
            generation_override=GenerationParams.model_validate(override) if override is not None else None,
            submitted_at=info["submitted_at_iso"], state=info["state"], started_at=info.get("started_at_iso"),
            finished_at=info.get("finished_at_iso"), runs=list(result.get("runs", [])),
            progress=RunProgress(**progress) if progress else None, error=info.get("error"),
            replay_expectation=info.get("replay_expectation"), replay_verdict=info.get("replay_verdict"),
            execution_provenance=info.get("execution_provenance"),
            base_weight_manifest=info.get("base_weight_shard_manifest"), sequence=int(data.get("sequence", 0)),
            source_training_job_id=info.get("source_training_job_id"), post_eval_gate=info.get("post_eval_gate"),
        )
