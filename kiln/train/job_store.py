"""Training job records on disk: one JSON file per job under `<data_dir>/train/jobs/`, written atomically.

A record is rewritten at every state change and, while running, at most every `SAVE_INTERVAL` seconds.
A record still queued or running at startup belongs to a process that stopped: it comes back failed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from kiln.store.atomic import atomic_write_json, fsync_dir
from kiln.store.clock import utc_now_rfc3339
from kiln.train.errors import job_not_found
from kiln.train.jobs import FAILED, TrainJob

log = logging.getLogger("kiln.train")

INTERRUPTED = "the server stopped before this job finished; no adapter was saved"


def job_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "train" / "jobs"


class TrainJobStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, job_id: str) -> Path:
        # Ids are generated, but a route names one: never leave the directory.
        if not job_id or "/" in job_id or "\\" in job_id or job_id.startswith("."):
            raise job_not_found(job_id)
        return self.root / f"{job_id}.json"

    def save(self, job: TrainJob) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path_for(job.job_id), job.to_archive())

    def delete(self, job_id: str) -> bool:
        try:
            os.unlink(self.path_for(job_id))
        except FileNotFoundError:
            return False
        fsync_dir(self.root)
        return True

    def load_all(self, *, keep: int | None = None) -> list[TrainJob]:
        """Every readable record, oldest first (by submission); interrupted jobs come back failed.
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
                job.state, job.error = FAILED, INTERRUPTED
                job.finished_at = job.finished_at or utc_now_rfc3339()
                self.save(job)
        return jobs
