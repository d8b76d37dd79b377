"""Where a job's rows come from -- inline, a named dataset split, a server-local JSONL file, or (DPO) a
judgment set -- and the provenance recorded with the job and the adapter (which source, and a hash of
exactly what was read)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.formats import GRPO_GROUPS, RAW, SFT_CHAT
from kiln.errors import KilnError
from kiln.store.hashing import sha256_json
from kiln.store.strict_json import loads_strict
from kiln.train.errors import invalid

MAX_PATH_BYTES = 1 << 30
# The dataset formats each job reads: preference rows are uploaded as raw (or as sft_chat rows whose
# `messages` are the prompt, with `chosen` and `rejected` beside them).
_FORMATS = {"sft": (SFT_CHAT,), "grpo": (GRPO_GROUPS,), "dpo": (RAW, SFT_CHAT),
            "opd": (RAW, SFT_CHAT), "distill": (RAW, SFT_CHAT)}
_INLINE_KEY = {"sft": "examples", "grpo": "groups", "dpo": "pairs", "opd": "prompts", "distill": "prompts"}


@dataclass
class TrainingData:
    rows: list[Any]
    labels: list[str]                # how errors name each row: "examples[3]", "dataset 'qa' (train) row 3"
    source: str                      # inline | dataset | path
    dataset: str | None = None
    split: str | None = None
    path: str | None = None
    dataset_corpus_sha256: str | None = None
    judgments: str | None = None

    @property
    def sha256(self) -> str:
        """Content hash of the rows as read (canonical JSON): what the adapter was trained on."""
        return "sha256:" + sha256_json(self.rows)

    def provenance(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "num_rows": len(self.rows), "data_sha256": self.sha256}
        for key in ("dataset", "split", "path", "dataset_corpus_sha256", "judgments"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def resolve_source(job_type: str, inline: list[Any] | None, dataset: str | None, split: str | None,
                   path: str | None, datasets: Any, *, judgments: str | None = None,
                   judgment_rows: Any = None) -> TrainingData:
    """Exactly one source (400 otherwise); dataset and path problems are 400/404 naming the field.
    `judgments` names a judgment set (DPO); `judgment_rows(name)` reads its rows (JSON) or raises."""
    key = _INLINE_KEY[job_type]
    sources = [(key, inline), ("dataset", dataset), ("dataset_path", path)]
    if job_type == "dpo":
        sources.append(("judgments", judgments))
    given = [name for name, value in sources if value is not None]
    if len(given) != 1:
        what = "none was given" if not given else f"got {', '.join(given)}"
        names = ", ".join(name for name, _ in sources[:-1]) + " or " + sources[-1][0]
        raise invalid(f"exactly one data source is required ({names}); {what}",
                      param=given[1] if len(given) > 1 else key,
                      hint=f"Send rows inline in `{key}`, name an uploaded dataset, or give an absolute JSONL path"
                           + (", or name a judgment set." if job_type == "dpo" else "."))
    if split is not None and dataset is None:
        raise invalid("dataset_split needs dataset", param="dataset_split")
    if inline is not None:
        if not inline:
            raise invalid(f"`{key}` must not be empty", param=key)
        return TrainingData(list(inline), [f"{key}[{i}]" for i in range(len(inline))], "inline")
    if dataset is not None:
        return _from_dataset(job_type, dataset, split or "train", datasets)
    if judgments is not None:
        return _from_judgments(judgments, judgment_rows)
    return _from_path(path or "")


def _from_judgments(name: str, judgment_rows: Any) -> TrainingData:
    if judgment_rows is None:
        raise KilnError(503, "judgment_store_unavailable", "the judgment store is not available", param="judgments",
                        hint="Send the pairs inline instead.")
    try:
        rows = judgment_rows(name)
    except KilnError as e:
        if e.status in (400, 404):  # a bad or unknown name is a mistake in this request
            raise invalid(f"judgment set {name!r}: {e.message.removeprefix('Invalid judgment: ')}",
                          param="judgments", hint="List judgment sets with GET /v1/judgments.") from None
        raise
    return TrainingData(rows, [f"judgments {name!r} row {r.get('id')!r}" for r in rows], "judgments", judgments=name)


def _from_dataset(job_type: str, name: str, split: str, datasets: Any) -> TrainingData:
    if datasets is None:
        raise KilnError(503, "dataset_registry_unavailable", "the dataset registry is not available",
                        param="dataset", hint="Send the rows inline instead.")
    try:
        manifest = datasets.get(name)
        want = _FORMATS[job_type]
        if manifest.get("format") not in want:
            needs = " or ".join(repr(w) for w in want)
            raise invalid(f"dataset {name!r} has format {manifest.get('format')!r}; {job_type} needs {needs}",
                          param="dataset", hint=f"Upload the data with format={want[0]}.")
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
