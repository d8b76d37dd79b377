"""Training checkpoints: what a job needs to continue after a crash or a shutdown.

Layout `<data_dir>/train/checkpoints/<job_id>/`:
  request.json   the job's request as submitted (output_name filled in): a resume plans from it again
  state.pt       the latest `TrainState`: trainable factors, the loop's state (optimizer moments, shuffle
                 generator, global RNG, data position) and the job's progress fields at that point

Both files are written atomically (temp file, fsync, rename), so a kill leaves the previous checkpoint
or the new one. The directory is removed (renamed aside, then deleted) once the job ends for good;
`sweep` deletes what a kill left of such a removal and directories without a request.
"""

from __future__ import annotations

import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.store import dirswap
from kiln.store.atomic import atomic_write_bytes, atomic_write_json
from kiln.store.sweep import is_atomic_temp, remove_path, sweep_temp_files
from kiln.train.loop import LoopState

log = logging.getLogger("kiln.train")

REQUEST_FILE, STATE_FILE = "request.json", "state.pt"
FORMAT = "kiln.train-checkpoint.v1"
# The job fields a checkpoint carries, so a resumed job's record continues from the same point.
PROGRESS_FIELDS = ("step", "epoch", "progress", "current_loss", "tokens_per_sec", "tokens_trained", "loss_curve",
                   "metrics")


def checkpoint_root(data_dir: str | Path) -> Path:
    return Path(data_dir) / "train" / "checkpoints"


@dataclass
class TrainState:
    loop: LoopState
    factors: dict[str, Tensor]                     # TrainableLora.state_dict()
    progress: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self, job_id: str) -> bytes:
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "job_id": job_id, "loop": self.loop.to_dict(), "factors": self.factors,
                    "progress": self.progress}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainState:
        obj = torch.load(io.BytesIO(data), weights_only=True)
        if obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} checkpoint")
        return cls(LoopState.from_dict(obj["loop"]), dict(obj["factors"]), dict(obj["progress"]))


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def dir(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or "\\" in job_id or job_id.startswith("."):
            raise ValueError(f"bad job id {job_id!r}")
        return self.root / job_id

    # -- the request ----------------------------------------------------------------------------
    def save_request(self, job_id: str, job_type: str, body: dict[str, Any]) -> None:
        atomic_write_json(self.dir(job_id) / REQUEST_FILE, {"job_type": job_type, "body": body}, indent=None)

    def load_request(self, job_id: str) -> tuple[str, dict[str, Any]] | None:
        try:
            data = json.loads((self.dir(job_id) / REQUEST_FILE).read_text(encoding="utf-8"))
            return data["job_type"], data["body"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def has_request(self, job_id: str) -> bool:
        return (self.dir(job_id) / REQUEST_FILE).is_file()

    # -- the state ------------------------------------------------------------------------------
    def save_state(self, job_id: str, state: TrainState) -> None:
        atomic_write_bytes(self.dir(job_id) / STATE_FILE, state.to_bytes(job_id))

    def load_state(self, job_id: str) -> TrainState | None:
        path = self.dir(job_id) / STATE_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return TrainState.from_bytes(data)
        except Exception as e:  # noqa: BLE001 - an unreadable checkpoint means starting over, not failing
            log.warning("training job %s: checkpoint %s unreadable (%s); starting from step 0", job_id, path, e)
            return None

    # -- removal and the startup sweep ----------------------------------------------------------
    def delete(self, job_id: str) -> None:
        path = self.dir(job_id)
        if path.is_dir():
            dirswap.remove(path)

    def sweep(self) -> list[str]:
        """Remove scratch copies and directories a kill left unusable (no request); returns what went."""
        done: list[str] = []
        if not self.root.is_dir():
            return done
        for entry in sorted(os.listdir(self.root)):
            path = self.root / entry
            if entry.startswith("."):
                if dirswap.scratch_owner(entry) is not None or is_atomic_temp(entry):
                    remove_path(path)
                    done.append(f"removed {path}")
                continue
            if not path.is_dir():
                continue
            done += sweep_temp_files(path)
            if not (path / REQUEST_FILE).is_file():
                remove_path(path)
                done.append(f"removed {path} (no {REQUEST_FILE})")
        return done
