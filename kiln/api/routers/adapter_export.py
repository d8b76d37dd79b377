"""GET /v1/adapters/{name}/export?format=peft|gguf: a stored adapter in a form other servers load.

`peft` answers a tar.gz of the PEFT folder whose `base_model_name_or_path` names the real base model;
`gguf` answers a llama.cpp LoRA GGUF (kiln.adapters.export). Headers tell the client how to serve it:
`x-kiln-base-model` (HF id or directory), `x-kiln-base-model-gguf` (a .gguf base for llama.cpp) and
`x-kiln-max-lora-rank`, which `kiln adapters export` turns into vllm / llama-server command lines.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from kiln.adapters.export import base_model_reference, describe, export_gguf, export_peft
from kiln.adapters.store import AdapterStore
from kiln.api.state import get_state
from kiln.errors import KilnError
from kiln.model.loader import default_model_path

router = APIRouter(tags=["adapters"])
FORMATS = ("peft", "gguf")


@router.get("/v1/adapters/{name}/export")
async def export_adapter(request: Request, name: str, format: str = "peft") -> Response:
    if format not in FORMATS:
        raise KilnError(400, "invalid_export_format", f"format must be one of {', '.join(FORMATS)}, not {format!r}",
                        param="format", hint="Use ?format=peft (vLLM, PEFT) or ?format=gguf (llama.cpp).")
    state = get_state(request)
    store: AdapterStore = state.services.adapter_store
    folder = store.require(name)
    model_path = state.settings.model.path
    ref = base_model_reference(model_path or str(default_model_path()), embedded=model_path is None)
    loaded = await run_in_threadpool(store.load_adapter, name)
    headers = {"x-kiln-max-lora-rank": str(describe(loaded.modules)["max_rank"])}
    if ref.hf:
        headers["x-kiln-base-model"] = ref.hf
    if ref.gguf:
        headers["x-kiln-base-model-gguf"] = ref.gguf
    if format == "peft":
        body = await run_in_threadpool(_peft_archive, folder, ref.hf)
        headers["content-disposition"] = f'attachment; filename="{name}.tar.gz"'
        return Response(body, media_type="application/gzip", headers=headers)
    config = state.require_engine().info.config
    body = await run_in_threadpool(_gguf_bytes, loaded.modules, config, name, ref.hf)
    headers["content-disposition"] = f'attachment; filename="{name}.gguf"'
    return Response(body, media_type="application/octet-stream", headers=headers)


def _peft_archive(folder: Path, base_model: str | None) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = export_peft(folder, Path(tmp), base_model=base_model)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for f in sorted(out.iterdir()):
                tar.add(f, arcname=f.name, recursive=False)
        return buf.getvalue()


def _gguf_bytes(modules, config, name: str, base_model: str | None) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = export_gguf(modules, config, Path(tmp) / f"{name}.gguf", name=name, base_model=base_model)
        return path.read_bytes()
