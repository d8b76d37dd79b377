from __future__ import annotations

import json
from typing import Any

import pytest

from kiln.data.datasets import DatasetStore
from kiln.data.judgments import JudgmentStore


def sft(user: str, assistant: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], **extra}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def judgment(i: int = 0, winner: str = "a", **extra: Any) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"question {i}"}], "response_a": f"long answer {i}",
            "response_b": f"short {i}", "winner": winner, **extra}


@pytest.fixture
def datasets(tmp_path) -> DatasetStore:
    return DatasetStore(tmp_path / "datasets")


@pytest.fixture
def judgments(tmp_path) -> JudgmentStore:
    return JudgmentStore(tmp_path / "judgments")
