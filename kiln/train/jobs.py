"""A training job's record: what was asked, where it stands, and what it produced (semantics.md §12.1).

The record is what GET /v1/train/status[/{id}] and /v1/train/jobs/{id} show and what the job store
persists. `post_eval` (the effective request block), `gate_outcome` (pending while the eval runs, then
promoted | kept | regression | demoted | inconclusive | error), `post_eval_verdict` (prose),
`post_eval_gate_evidence` (every number of the decision) and `linked_eval_job_ids` record the
post-training eval gate (§8.14); they stay empty for a job without post_eval.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from typing import Any

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "running", "completed", "failed", "cancelled"
# Stopped by a shutdown or a crash with its request (and maybe a checkpoint) kept: nothing runs, but
# POST /v1/train/jobs/{id}/resume continues it, so it still owns its adapter name.
INTERRUPTED = "interrupted"
TERMINAL = (COMPLETED, FAILED, CANCELLED, INTERRUPTED)
MAX_CURVE_POINTS = 2000


@dataclass
class TrainJob:
    job_id: str
    job_type: str                      # sft | grpo | dpo | opd | distill
    adapter_name: str
    config: dict[str, Any]             # the effective config (defaults filled in)
    training_data: dict[str, Any]      # provenance: source, dataset/split/path, rows, data_sha256
    submitted_at: str
    state: str = QUEUED
    base_adapter: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    progress: float = 0.0
    step: int = 0
    total_steps: int = 0
    epoch: int = 0
    current_loss: float | None = None
    tokens_per_sec: float | None = None
    tokens_trained: int = 0
    elapsed_secs: float = 0.0
    loss_curve: list[dict[str, Any]] = field(default_factory=list)   # [{step, loss, ...}], thinned when long
    metrics: dict[str, float] = field(default_factory=dict)          # latest step's extra metrics (GRPO: kl; DPO: reward_margin, ...)
    error: str | None = None
    adapter_path: str | None = None
    train_receipt: dict[str, Any] | None = None
    activated: bool | None = None        # auto_load outcome; None when not attempted
    activation_error: str | None = None
    webhook_url: str | None = None       # this job's receiver (else the server's [training] webhook_url)
    webhook: dict[str, Any] | None = None   # delivery outcome: {url, status_code} or {url, error}
    memory: dict[str, Any] = field(default_factory=dict)   # rss_start_mb, rss_peak_mb, peak_is_high_water_mark
    cancel_requested: bool = False
    post_eval: dict[str, Any] | None = None
    gate_outcome: str | None = None
    post_eval_verdict: str | None = None
    post_eval_gate_evidence: dict[str, Any] | None = None
    linked_eval_job_ids: list[str] = field(default_factory=list)
    checkpoint: dict[str, Any] | None = None      # the latest saved checkpoint: {step, saved_at}
    resumed_from_step: int | None = None          # the checkpoint step this run continued from
    resumes: int = 0                              # how many times the job was resumed
    held_out: dict[str, Any] | None = None        # DPO: held-out pairs, the trained adapter against the start

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def add_point(self, point: dict[str, Any]) -> None:
        """Append a loss-curve point; past MAX_CURVE_POINTS every other point is dropped (the first
        and the latest always stay), so a long job's curve keeps its shape in bounded space."""
        self.loss_curve.append(point)
        if len(self.loss_curve) > MAX_CURVE_POINTS:
            last = self.loss_curve[-1]
            self.loss_curve = self.loss_curve[:-1:2] + [last]

    def status(self, now: float | None = None) -> dict[str, Any]:
        """TrainingStatus: the summary every list shows."""
        out: dict[str, Any] = {
            "job_id": self.job_id, "job_type": self.job_type, "state": self.state,
            "progress": round(self.progress, 6), "step": self.step, "total_steps": self.total_steps,
            "epoch": self.epoch, "current_loss": self.current_loss, "tokens_per_sec": self.tokens_per_sec,
            "adapter_name": self.adapter_name, "submitted_at": self.submitted_at, "started_at": self.started_at,
            "finished_at": self.finished_at, "elapsed_secs": round(self._elapsed(now), 3),
            "training_data": self.training_data,
        }
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.error is not None:
            out["error"] = self.error
        if self.cancel_requested and not self.terminal:
            out["cancel_requested"] = True
        for key in ("activated", "activation_error", "gate_outcome", "post_eval_verdict", "post_eval_gate_evidence"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.linked_eval_job_ids:
            out["linked_eval_job_ids"] = list(self.linked_eval_job_ids)
        if self.state == INTERRUPTED:
            out["resumable"] = True
        if self.checkpoint is not None:
            out["checkpoint"] = dict(self.checkpoint)
        if self.resumes:
            out["resumes"], out["resumed_from_step"] = self.resumes, self.resumed_from_step
        if self.held_out is not None:
            out["held_out"] = dict(self.held_out)
        return out

    def detail(self) -> dict[str, Any]:
        """Everything: the status plus config, loss curve, receipt, memory and webhook delivery."""
        out = self.status()
        out.update({
            "config": self.config, "base_adapter": self.base_adapter, "tokens_trained": self.tokens_trained,
            "loss_curve": list(self.loss_curve), "adapter_path": self.adapter_path, "train_receipt": self.train_receipt,
            "memory": dict(self.memory), "webhook": self.webhook, "post_eval": self.post_eval,
            "post_eval_gate_evidence": self.post_eval_gate_evidence, "linked_eval_job_ids": self.linked_eval_job_ids,
        })
        return out

    def _elapsed(self, now: float | None) -> float:
        if self.state == RUNNING and self.started_at:
            return max(0.0, (now or time.time()) - _epoch(self.started_at))
        return self.elapsed_secs

    def to_archive(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_archive(cls, data: dict[str, Any]) -> TrainJob:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
