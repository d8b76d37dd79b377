"""Where a job's rows come from -- inline, a named dataset split, or a server-local JSONL file -- and the
provenance recorded with the job and the adapter (which source, and a hash of exactly what was read)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.formats import GRPO_GROUPS, SFT_CHAT
from kiln.errors import KilnError
from kiln.store.hashing import sha256_json
from kiln.store.strict_json import loads_strict
from kiln.train.errors import invalid

MAX_PATH_BYTES = 1 << 30
_FORMAT = {"sft": SFT_CHAT, "grpo": GRPO_GROUPS}
_INLINE_KEY = {"sft": "examples", "grpo": "groups"}


@dataclass
class TrainingData:
    rows: list[Any]
    labels: list[str]                # how errors name each row: "examples[3]", "dataset 'qa' (train) row 3"
    source: str                      # inline | dataset | path
    dataset: str | None = None
    split: str | None = None
    path: str | None = None
    dataset_corpus_sha256: str | None = None

    @property
    def sha256(self) -> str:
        """Content hash of the rows as read (canonical JSON): what the adapter was trained on."""
        return "sha256:" + sha256_json(self.rows)

    def provenance(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "num_rows": len(self.rows), "data_sha256": self.sha256}
        for key in ("dataset", "split", "path", "dataset_corpus_sha256"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def resolve_source(job_type: str, inline: list[Any] | None, dataset: str | None, split: str | None,
                   path: str | None, datasets: Any) -> TrainingData:
    """Exactly one source (400 otherwise); dataset and path problems are 400/404 naming the field."""
    key = _INLINE_KEY[job_type]
    given = [name for name, value in ((key, inline), ("dataset", dataset), ("dataset_path", path))
             if value is not None]
    if len(given) != 1:
        what = "none was given" if not given else f"got {', '.join(given)}"
        raise invalid(f"exactly one data source is required ({key}, dataset or dataset_path); {what}",
                      param=given[1] if len(given) > 1 else key,
                      hint=f"Send rows inline in `{key}`, name an uploaded dataset, or give an absolute JSONL path.")
    if split is not None and dataset is None:
        raise invalid("dataset_split needs dataset", param="dataset_split")
    if inline is not None:
        if not inline:
            raise invalid(f"`{key}` must not be empty", param=key)
        return TrainingData(list(inline), [f"{key}[{i}]" for i in range(len(inline))], "inline")
    if dataset is not None:
        return _from_dataset(job_type, dataset, split or "train", datasets)
    return _from_path(path or "")


def _from_dataset(job_type: str, name: str, split: str, datasets: Any) -> TrainingData:
    if datasets is None:
        raise KilnError(503, "dataset_registry_unavailable", "the dataset registry is not available",
                        param="dataset", hint="Send the rows inline instead.")
    try:
        manifest = datasets.get(name)
        want = _FORMAT[job_type]
        if manifest.get("format") != want:
            raise invalid(f"dataset {name!r} has format {manifest.get('format')!r}; {job_type} needs {want!r}",
                          param="dataset", hint=f"Upload the data with format={want}.")
        rows = datasets.read_rows(name, split, nonempty=True)
    except KilnError as e:
        if e.code == "dataset_invalid" and e.status == 400:
            param = "dataset_split" if e.param == "split" else "dataset"
            raise invalid(e.message.removeprefix("Invalid eval dataset: "), param=param, hint=e.hint) from None
        raise
    labels = [f"dataset {name!r} ({split}) row {i}" for i in range(len(rows))]
    return TrainingData(rows, labels, "dataset", dataset=name, split=split,
                        dataset_corpus_sha256=manifest.get("corpus_sha256"))


def _from_path(raw: str) -> TrainingData:
    path = Path(raw)
    if not path.is_absolute():
        raise invalid("dataset_path must be an absolute path on the server", param="dataset_path")
    if not path.is_file():
        raise invalid(f"dataset_path {raw!r} is not a readable file", param="dataset_path")
    if path.stat().st_size > MAX_PATH_BYTES:
        raise invalid(f"dataset_path {raw!r} is larger than {MAX_PATH_BYTES >> 20} MiB", param="dataset_path")
    rows, labels = [], []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(loads_strict(line))
            except (json.JSONDecodeError, ValueError) as e:
                raise invalid(f"dataset_path line {lineno} is not valid JSON: {e}", param="dataset_path") from None
            labels.append(f"dataset_path line {lineno}")
    if not rows:
        raise invalid(f"dataset_path {raw!r} holds no rows", param="dataset_path")
    return TrainingData(rows, labels, "path", path=str(path))
