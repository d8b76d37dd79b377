"""Eval job archives: one pretty JSON file per job under `<data_dir>/eval/jobs/`, written atomically.

A job's file is first written when it is queued (before its id is answered), rewritten when it starts
running and after each finished run and at the end. A file still saying running/queued at startup belongs to a process that
died mid-job: it is reloaded as failed, keeping the runs that had finished.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kiln.errors import KilnError
from kiln.evals.jobs import EvalJob
from kiln.evals.replay import replay_verdict
from kiln.store.clock import utc_now_rfc3339
from kiln.store.records import JsonRecordDir

log = logging.getLogger("kiln.evals")

INTERRUPTED = "the server stopped while this job was running; runs that had finished are kept"


def job_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "eval" / "jobs"


def _not_found(job_id: str) -> KilnError:
    return KilnError(404, "eval_job_not_found", f"Eval job {job_id!r} not found", param="job_id",
                     hint="List jobs with GET /v1/eval/jobs.")


class EvalJobStore(JsonRecordDir):
    def __init__(self, root: str | Path) -> None:
        super().__init__(root, _not_found)

    def save(self, job: EvalJob) -> None:
        self.write(job.job_id, job.to_archive())

    def load_all(self, *, keep: int | None = None) -> list[EvalJob]:
        """Every readable archive, oldest first; an interrupted job comes back failed.

        With `keep`, only the newest `keep` files (by mtime) are loaded and older ones are deleted.
        """
        if not self.root.is_dir():
            return []
        files = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if keep is not None and len(files) > keep:
            for old in files[: len(files) - keep]:
                log.info("pruning old eval job archive %s", old.name)
                old.unlink(missing_ok=True)
            files = files[len(files) - keep:]
        jobs = []
        for path in files:
            try:
                job = EvalJob.from_archive(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError, KilnError) as e:
                log.warning("skipping unreadable eval job archive %s: %s", path.name, getattr(e, "message", e))
                continue
            if path.stem != job.job_id:
                log.warning("skipping eval job archive %s: it holds job %s", path.name, job.job_id)
                continue
            if not job.terminal:
                job.state, job.error = "failed", INTERRUPTED
                job.finished_at = job.finished_at or utc_now_rfc3339()
                if job.replay_expectation is not None:
                    job.replay_verdict = replay_verdict(job.replay_expectation, None, error=INTERRUPTED)
                self.save(job)
            jobs.append(job)
        return jobs
