"""Run a planned training job in-process and read back the adapter it saved (shared by the job tests)."""

from __future__ import annotations

from kiln.store.clock import utc_now_rfc3339
from kiln.train.executor import JobContext, execute
from kiln.train.jobs import TrainJob
from kiln.train.trainable_lora import TrainableLora


def run_planned(plan_, engine, store) -> TrainJob:
    """Execute `plan_` to its end on `engine`, saving into `store`; the finished job record."""
    job = TrainJob(plan_.job_id, plan_.job_type, plan_.adapter_name, plan_.config, plan_.data.provenance(),
                   utc_now_rfc3339(), started_at=utc_now_rfc3339())
    execute(job, plan_, JobContext(engine, store, None), on_update=lambda: None, should_stop=lambda: False)
    return job


def saved_lora(engine, store, name: str) -> TrainableLora:
    """The adapter `name` as `store` holds it, loaded into a TrainableLora over `engine`'s model."""
    config = store.read_config(name)
    lora = TrainableLora(engine.model.config, config.r, config.lora_alpha, config.target_modules)
    lora.load_factors(store.load_lora_tensors(name))
    return lora
