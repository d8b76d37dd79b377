"""Training job records on disk: one JSON file per job under `<data_dir>/train/jobs/`, written atomically.

A record is rewritten at every state change and, while running, at most every `SAVE_INTERVAL` seconds.
A record still queued or running at startup belongs to a process that stopped: it comes back
`interrupted` when its request was kept (a resume continues it from its latest checkpoint), else failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from kiln.store.clock import utc_now_rfc3339
from kiln.store.records import JsonRecordDir
from kiln.train.errors import job_not_found
from kiln.train.jobs import FAILED, TrainJob
from kiln.train.jobs import INTERRUPTED as INTERRUPTED_STATE

log = logging.getLogger("kiln.train")

INTERRUPTED = "the server stopped before this job finished; no adapter was saved"
RESUMABLE = ("the server stopped before this job finished; POST /v1/train/jobs/{job_id}/resume continues it from "
             "its latest checkpoint")


def job_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "train" / "jobs"


class TrainJobStore(JsonRecordDir):
    def __init__(self, root: str | Path) -> None:
        super().__init__(root, job_not_found)

    def save(self, job: TrainJob) -> None:
        self.write(job.job_id, job.to_archive())

    def load_all(self, *, keep: int | None = None,
                 resumable: Callable[[str], bool] | None = None) -> list[TrainJob]:
        """Every readable record, oldest first (by submission). A job that was queued or running comes
        back `interrupted` when `resumable(job_id)` says its request was kept, else failed.
        With `keep`, only the newest `keep` records stay and older files are deleted."""
        if not self.root.is_dir():
            return []
        jobs: list[TrainJob] = []
        for path in self.root.glob("*.json"):
            try:
                job = TrainJob.from_archive(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError) as e:
                log.warning("skipping unreadable training job record %s: %s", path.name, e)
                continue
            if path.stem != job.job_id:
                log.warning("skipping training job record %s: it holds job %s", path.name, job.job_id)
                continue
            jobs.append(job)
        jobs.sort(key=lambda j: j.submitted_at)
        if keep is not None and len(jobs) > keep:
            for old in jobs[: len(jobs) - keep]:
                self.delete(old.job_id)
            jobs = jobs[len(jobs) - keep:]
        for job in jobs:
            if not job.terminal:
                if resumable is not None and resumable(job.job_id):
                    job.state, job.error = INTERRUPTED_STATE, RESUMABLE.format(job_id=job.job_id)
                else:
                    job.state, job.error = FAILED, INTERRUPTED
                job.finished_at = job.finished_at or utc_now_rfc3339()
                self.save(job)
        return jobs
