"""Training handed to Hugging Face TRL and brought back (kiln.train.hf_bundle):

POST /v1/train/hf/sft/exports        {name, dataset | examples, dataset_split?, config?} -> a bundle folder
                                     under <data_dir>/hf-exports/<name> (409 when it exists)
GET  /v1/train/hf/sft/exports/{name} the bundle as tar.gz
POST /v1/train/hf/dpo/exports        {name, judgments | examples, config?} -> a DPOTrainer bundle; a judgment
                                     set gives one pair per verdict a or b (ties and skips are left out);
                                     examples are {prompt: [messages], chosen, rejected}
GET  /v1/train/hf/dpo/exports/{name} the bundle as tar.gz
POST /v1/train/hf/peft/imports/{name} {path}: a PEFT folder (TRL's output) stored as adapter `name`, through
                                     the upload's checks; a path outside the exports folder needs
                                     server.allow_external_lora_paths, as /v1/load_lora_adapter does.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kiln.adapters.export import base_model_reference
from kiln.adapters.importing import import_adapter_folder
from kiln.api.errors import parse_model, read_json_body
from kiln.api.openapi import request_body
from kiln.api.state import ServerState, get_state
from kiln.data.formats import sft_problem
from kiln.errors import KilnError
from kiln.store.folder_archive import pack_folder
from kiln.store.names import validate_name
from kiln.train.hf_bundle import DpoBundleConfig, write_dpo_bundle, write_sft_bundle
from kiln.train.requests import SftConfig

router = APIRouter(tags=["training"])
CODE = "hf_export_invalid"
PREFIX = "Invalid HF export request: "


class SftExportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dataset: str | None = None
    dataset_split: str | None = None
    examples: list[Any] | None = None
    config: SftConfig = Field(default_factory=SftConfig)


class DpoExportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    judgments: str | None = None
    examples: list[Any] | None = None
    config: DpoBundleConfig = Field(default_factory=DpoBundleConfig)


class PeftImportBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str


def export_root(state: ServerState) -> Path:
    return Path(state.settings.data.data_dir) / "hf-exports"


def _rows(state: ServerState, body: SftExportBody) -> list[dict[str, Any]]:
    if (body.dataset is None) == (body.examples is None):
        raise KilnError(400, CODE, PREFIX + "give exactly one of dataset or examples", param="dataset")
    if body.dataset is not None:
        rows = state.services.datasets.read_rows(body.dataset, body.dataset_split or "train", nonempty=True)
    else:
        rows = list(body.examples or [])
    for i, row in enumerate(rows):
        problem = sft_problem(row)
        if problem is not None:
            param = f"examples[{i}]" if body.examples is not None else "dataset"
            raise KilnError(400, CODE, PREFIX + f"row {i}: {problem}", param=param)
    if not rows:
        raise KilnError(400, CODE, PREFIX + "no rows to train on", param="examples")
    return rows


def _pairs(state: ServerState, body: DpoExportBody) -> list[dict[str, Any]]:
    if (body.judgments is None) == (body.examples is None):
        raise KilnError(400, CODE, PREFIX + "give exactly one of judgments or examples", param="judgments")
    if body.judgments is not None:
        pairs = []
        for row in state.services.judgments.rows(body.judgments):
            if row["winner"] in ("a", "b"):
                win, lose = ("response_a", "response_b") if row["winner"] == "a" else ("response_b", "response_a")
                pairs.append({"prompt": row["prompt"], "chosen": row[win], "rejected": row[lose]})
        if not pairs:
            raise KilnError(400, CODE, PREFIX + f"judgment set {body.judgments!r} has no verdict a or b",
                            param="judgments")
        return pairs
    pairs = list(body.examples or [])
    for i, pair in enumerate(pairs):
        ok = isinstance(pair, dict) and sft_problem({"messages": pair.get("prompt")}) is None and \
            isinstance(pair.get("chosen"), str) and isinstance(pair.get("rejected"), str)
        if not ok:
            raise KilnError(400, CODE, PREFIX + f"examples[{i}] must be {{prompt: [messages], chosen: str, "
                            "rejected: str}", param=f"examples[{i}]")
    if not pairs:
        raise KilnError(400, CODE, PREFIX + "no pairs to train on", param="examples")
    return pairs


def _export(state: ServerState, body: SftExportBody | DpoExportBody) -> dict[str, Any]:
    validate_name(body.name, param="name")
    engine = state.require_engine()
    rows = _rows(state, body) if isinstance(body, SftExportBody) else _pairs(state, body)
    root = export_root(state)
    dest = root / body.name
    if dest.exists():
        raise KilnError(409, "hf_export_exists", f"An export named {body.name!r} exists.", param="name",
                        hint="Pick another name, or remove the folder under <data_dir>/hf-exports.")
    from kiln.model.loader import default_model_path

    model_path = state.settings.model.path
    ref = base_model_reference(model_path or str(default_model_path()), embedded=model_path is None)
    staging = root / f".tmp-{uuid.uuid4().hex}"
    try:
        write = write_sft_bundle if isinstance(body, SftExportBody) else write_dpo_bundle
        common = {"name": body.name, "chat_template": engine.tokenizer.chat_template,
                  "base_model": ref.hf or str(model_path), "config": body.config}
        files = write(staging, rows=rows, **common) if isinstance(body, SftExportBody) else \
            write(staging, pairs=rows, **common)
        os.rename(staging, dest)  # whole or not at all
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"status": "exported", "name": body.name, "path": str(dest.resolve()), "files": files, "rows": len(rows),
            "base_model": ref.hf, "command": f"cd {dest.resolve()} && accelerate launch train.py",
            "import": f"POST /v1/train/hf/peft/imports/{body.name} {{\"path\": \"{dest.resolve() / 'adapter'}\"}}"}


@router.post("/v1/train/hf/sft/exports")
@request_body(SftExportBody)
async def export_sft(request: Request) -> dict[str, Any]:
    body = parse_model(SftExportBody, await read_json_body(request, code=CODE, prefix=PREFIX), code=CODE,
                       prefix=PREFIX)
    return await run_in_threadpool(_export, get_state(request), body)


@router.post("/v1/train/hf/dpo/exports")
@request_body(DpoExportBody)
async def export_dpo(request: Request) -> dict[str, Any]:
    body = parse_model(DpoExportBody, await read_json_body(request, code=CODE, prefix=PREFIX), code=CODE,
                       prefix=PREFIX)
    return await run_in_threadpool(_export, get_state(request), body)


@router.get("/v1/train/hf/sft/exports/{name}")
@router.get("/v1/train/hf/dpo/exports/{name}")
async def download_export(request: Request, name: str) -> Response:
    validate_name(name, param="name")
    folder = export_root(get_state(request)) / name
    if not folder.is_dir():
        raise KilnError(404, "hf_export_not_found", f"No export named {name!r}.", param="name")
    data = await run_in_threadpool(pack_folder, folder)
    return Response(data, media_type="application/gzip",
                    headers={"content-disposition": f'attachment; filename="{name}.tar.gz"'})


def _import(state: ServerState, name: str, path: str) -> dict[str, Any]:
    folder = Path(path).expanduser().resolve()
    inside = folder.is_relative_to(export_root(state).resolve())
    if not inside and not state.settings.server.allow_external_lora_paths:
        raise KilnError(403, "lora_path_not_allowed", "path outside <data_dir>/hf-exports is not allowed on this "
                        "server.", param="path", hint="Upload the folder (POST /v1/adapters/upload), or start the "
                        "server with server.allow_external_lora_paths = true.")
    info, imported = import_adapter_folder(state.services.adapter_store, name, folder, param="path")
    return {"status": "imported" if imported else "unchanged", **info.to_dict()}


@router.post("/v1/train/hf/peft/imports/{name}")
@request_body(PeftImportBody)
async def import_peft(request: Request, name: str) -> dict[str, Any]:
    body = parse_model(PeftImportBody, await read_json_body(request, code=CODE, prefix=PREFIX), code=CODE,
                       prefix=PREFIX)
    return await run_in_threadpool(_import, get_state(request), name, body.path)
