"""Dataset routes: upload, list, show, rows, split, delete (semantics.md §1.6, §9).

Needs `state.services.datasets`, a DatasetStore under `<data_dir>/datasets` built by kiln.server.build_server.
Handlers that touch the disk are plain `def` (or hand the work to the thread pool) because the
store takes file locks and fsyncs.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from kiln.api.errors import read_json_body
from kiln.api.state import get_state
from kiln.data.datasets import DatasetStore, check_dataset_name, check_split
from kiln.data.formats import INVALID, invalid
from kiln.errors import KilnError

router = APIRouter(tags=["evals"])

DEFAULT_ROWS_LIMIT = 100
MAX_ROWS_LIMIT = 5000



def _store(request: Request) -> DatasetStore:
    return get_state(request).services.datasets


def _text_field(form: Any, key: str) -> str | None:
    value = form.get(key)
    if value is None:
        return None
    if isinstance(value, UploadFile):
        raise invalid(f"multipart field `{key}` must be text, not a file", param=key)
    return value


@router.post("/v1/eval/datasets/upload")
async def upload_dataset(request: Request) -> dict[str, Any]:
    store = _store(request)
    try:
        form = await request.form(max_files=4, max_fields=64)
    except KilnError:
        raise
    except Exception as e:
        raise invalid(f"the body is not a readable multipart form: {e}",
                      hint="Send multipart/form-data with fields name, format, description and file.") from None
    try:
        name = (_text_field(form, "name") or "").strip()
        if not name:
            raise invalid("missing `name` field", param="name")
        check_dataset_name(name)
        fmt = _text_field(form, "format")
        description = _text_field(form, "description")
        file = form.get("file")
        if file is None:
            raise invalid("missing `file` field", param="file")
        source = file.file if isinstance(file, UploadFile) else file.encode("utf-8")
        return await run_in_threadpool(store.create, name, source, fmt=fmt, description=description)
    finally:
        await form.close()


@router.get("/v1/eval/datasets")
def list_datasets(request: Request) -> dict[str, Any]:
    return {"datasets": _store(request).list()}


@router.get("/v1/eval/datasets/{name}")
def get_dataset(request: Request, name: str) -> dict[str, Any]:
    return _store(request).get(name)


def _limit(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_ROWS_LIMIT
    try:
        value = int(raw)
    except ValueError:
        raise invalid(f"limit must be an integer, got {raw!r}", param="limit") from None
    return max(1, min(MAX_ROWS_LIMIT, value))


@router.get("/v1/eval/datasets/{name}/rows")
def dataset_rows(request: Request, name: str, limit: str | None = None, split: str | None = None) -> dict[str, Any]:
    store = _store(request)
    check_dataset_name(name)
    if split == "":
        split = None
    if split is not None:
        check_split(split)
    n = _limit(limit)
    rows = store.read_rows(name, split, limit=n)
    return {"name": name, "split": split, "limit": n, "rows": rows}


@router.get("/v1/eval/datasets/{name}/split")
def get_split(request: Request, name: str) -> dict[str, Any]:
    return _store(request).split_manifest(name)


@router.put("/v1/eval/datasets/{name}/split")
async def put_split(request: Request, name: str) -> dict[str, Any]:
    check_dataset_name(name)
    body = await read_json_body(request, code="dataset_invalid", prefix=INVALID)
    return await run_in_threadpool(_store(request).set_split, name, body)


@router.delete("/v1/eval/datasets/{name}")
def delete_dataset(request: Request, name: str) -> dict[str, Any]:
    _store(request).delete(name)
    return {"status": "deleted", "name": name}
