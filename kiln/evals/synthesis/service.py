"""What the synthesis routes do (semantics.md §1.6, §10): synthesize a suite from a dataset partition,
preview it, or save it and queue on-demand runs of it against adapters."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kiln.data.datasets import DatasetStore, check_dataset_name
from kiln.data.formats import invalid
from kiln.evals.intake import job_for_run
from kiln.evals.requests import RunRequest
from kiln.evals.suite import aggregation_to_json, suite_summary
from kiln.evals.suite_store import SuiteStore
from kiln.evals.synthesis.config import PreviewBody, SynthesisConfig, SynthesizeBody
from kiln.evals.synthesis.pipeline import SynthesisResult, synthesize

PREVIEW_EXAMPLES = 10


def run_synthesis(store: DatasetStore, name: str, split: str, config: SynthesisConfig,
                  max_conversations: int | None = None) -> SynthesisResult:
    check_dataset_name(name)
    if store.partition_count(name, split) == 0:  # 404 first when the dataset does not exist
        raise invalid(f"dataset {name!r} has no rows in its {split} partition", param="source_split",
                      hint="Pick another source_split, or change the split with PUT /v1/eval/datasets/{name}/split.")
    with contextlib.closing(store.iter_rows(name, split)) as rows:
        return synthesize(rows, config, dataset=name, source_split=split, max_conversations=max_conversations)


async def preview(store: DatasetStore, name: str, body: PreviewBody) -> dict[str, Any]:
    result = await asyncio.to_thread(run_synthesis, store, name, body.source_split, body, max(body.head_n, 1))
    suite = result.suite
    return {
        "examples": result.suite_json()["examples"][:PREVIEW_EXAMPLES],
        "stats": result.stats.to_json(),
        "suite_name": suite.name,
        "default_scorer_kind": suite.default_scorer.kind,
        "aggregation": aggregation_to_json(suite.aggregation),
        "completions_per_example": suite.k,
        "source_split": body.source_split,
    }


async def synthesize_and_save(datasets: DatasetStore, suites: SuiteStore, jobs: Any, name: str,
                              body: SynthesizeBody) -> dict[str, Any]:
    """Synthesize, save the suite, and queue one run per `run_against` adapter through `jobs`."""
    adapters = list(body.run_against or [])
    # Checked before any work, so an unknown adapter never leaves a saved suite behind that the
    # caller did not get runs for.
    for adapter in adapters:
        jobs.ctx.resolve_target(adapter or None)
    result = await asyncio.to_thread(run_synthesis, datasets, name, body.source_split, body)
    await asyncio.to_thread(suites.save, result.suite, force=body.force)
    queued = [_queue_run(jobs, result.suite.name, adapter) for adapter in adapters]
    return {"suite": suite_summary(result.suite), "stats": result.stats.to_json(), "queued_eval_job_ids": queued}


def _queue_run(jobs: Any, suite_name: str, adapter: str) -> str:
    """Queue one on-demand run of the registered suite against `adapter` ("" = base), no generation override."""
    job = job_for_run(jobs.ctx, RunRequest(suite_name=suite_name, adapter=adapter))
    jobs.start_worker()
    return jobs.submit(job).job_id
