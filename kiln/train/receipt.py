"""The training receipt saved next to the adapter (train_receipt.json), and the manifest lineage."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln import __version__
from kiln.train.jobs import TrainJob
from kiln.train.plan import TrainingPlan

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

SCHEMA = "kiln.train-receipt.v1"


def build_receipt(job: TrainJob, plan: TrainingPlan, engine: EngineView, *, finished_at: str, duration_secs: float,
                  base_dtype: str) -> dict[str, Any]:
    identity, info = engine.identity, engine.info
    curve = job.loss_curve
    receipt = {
        "schema": SCHEMA,
        "status": "completed",
        "job_id": job.job_id,
        "job_type": job.job_type,
        "adapter_name": job.adapter_name,
        "base_adapter": plan.lora.base_adapter,
        "base_adapter_sha256": plan.lora.base_adapter_sha256,
        "base_model": {
            "served_model_id": getattr(info, "served_model_id", None),
            "path": getattr(info, "path", None),
            "base_model_sha256": getattr(identity, "base_model_sha256", None),
            "model_config_sha256": getattr(identity, "model_config_sha256", None),
            "chat_template_sha256": getattr(identity, "chat_template_sha256", None),
        },
        "config": plan.config,
        "training_data": plan.data.provenance(),
        "data_hash": plan.data.sha256,
        "data_stats": plan.stats,
        "training_precision": {"base": base_dtype, "lora_params": "float32", "optimizer": "adamw"},
        "steps": job.step,
        "tokens_trained": job.tokens_trained,
        "initial_loss": curve[0]["loss"] if curve else None,
        "final_loss": job.current_loss,
        "loss_curve": curve,
        "started_at": job.started_at,
        "finished_at": finished_at,
        "duration_secs": round(duration_secs, 3),
        "kiln_version": __version__,
    }
    if job.held_out is not None:
        receipt["held_out"] = job.held_out
    return receipt


def build_lineage(plan: TrainingPlan, engine: EngineView, base_dtype: str) -> dict[str, Any]:
    identity = engine.identity
    return {
        "parent_adapter": plan.lora.base_adapter,
        "training_data_hash": plan.data.sha256,
        "training_data_source": plan.data.dataset or plan.data.source,
        "training_data_path": plan.data.path,
        "training_precision": f"base {base_dtype}, lora float32",
        "training_chat_template_hash": getattr(identity, "chat_template_sha256", None),
        "model_config_hash": getattr(identity, "model_config_sha256", None),
    }
