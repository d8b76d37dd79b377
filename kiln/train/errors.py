"""The training routes' client errors: one code, one message prefix (semantics.md §13.4)."""

from __future__ import annotations

from kiln.errors import KilnError

CODE = "training_invalid_request"
PREFIX = "Invalid training request: "


def invalid(message: str, *, param: str | None = None, hint: str | None = None) -> KilnError:
    return KilnError(400, CODE, PREFIX + message, param=param, hint=hint)


def job_not_found(job_id: str) -> KilnError:
    return KilnError(404, "training_job_not_found", f"Training job {job_id!r} not found.", param="job_id",
                     hint="GET /v1/train/status lists the jobs this server tracks.")


def row_param(label: str, field: str | None = None) -> str:
    """The request field a row problem points at: `examples[3].messages` for inline rows; for rows
    read from a dataset or file, the field that named the source (the message names the row)."""
    if label.startswith("dataset_path"):
        return "dataset_path"
    if label.startswith("dataset "):
        return "dataset"
    return f"{label}.{field}" if field else label


def row_invalid(label: str, problem: str, *, field: str | None = None, hint: str | None = None) -> KilnError:
    """A row problem; without `field`, the field is read off the problem text ("messages[1].role must ...")."""
    if field is None:
        head = problem.split(" ", 1)[0].strip("`")
        field = head if head.startswith(("messages", "completions")) else None
    return invalid(f"{label}: {problem}", param=row_param(label, field), hint=hint)
