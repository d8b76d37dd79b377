"""Batched multi-adapter serving, measured: N streams spread over K adapters against N base-model
streams in the same run (target: >= 0.7x).

The adapters are random rank-r LoRAs on every projection of the served model, written in PEFT format
and uploaded through `POST /v1/adapters/upload`, so the server handles them exactly as a user's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from kiln.bench.client_load import BenchError, Endpoint
from kiln.bench.prompts import BenchPrompt

ADAPTER_PREFIX = "kiln-bench-lora"


def model_config(model_path: str):
    """The served model's shapes, read from the same file the server loads (no weights)."""
    from kiln.model.config import ModelConfig
    from kiln.model.gguf_file import read_gguf_metadata

    p = Path(model_path)
    if p.is_file():
        return ModelConfig.from_gguf_metadata(read_gguf_metadata(str(p)))
    return ModelConfig.from_hf_dict(json.loads((p / "config.json").read_text()))


def random_adapter_archive(model_path: str, name: str, rank: int, seed: int) -> bytes:
    """A PEFT LoRA on every projection with small random factors, as the tar.gz the upload route takes."""
    import torch

    from kiln.adapters.archive import iter_tar_gz
    from kiln.adapters.peft_format import config_dict
    from kiln.adapters.store import AdapterStore
    from kiln.model.lora import module_shapes

    cfg = model_config(model_path)
    g = torch.Generator().manual_seed(seed)
    factors = {(layer, m): (torch.randn(rank, i, generator=g) * 0.01, torch.randn(o, rank, generator=g) * 0.01)
               for layer in range(cfg.num_hidden_layers) for m, (i, o) in module_shapes(cfg).items()}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-adapter-") as tmp:
        store = AdapterStore(tmp)
        store.save_adapter(name, factors, config_dict(rank, 2.0 * rank))
        return b"".join(iter_tar_gz(store.require(name), name))


def upload_adapters(endpoint: Endpoint, model_path: str, count: int, rank: int) -> tuple[list[str], list[str]]:
    """Upload `count` benchmark adapters (kept when a server already has them). Returns every name and
    the names this call uploaded, which remove_adapters takes away again after the measurement."""
    names = [f"{ADAPTER_PREFIX}-r{rank}-{i}" for i in range(count)]
    uploaded: list[str] = []
    with httpx.Client(base_url=endpoint.base_url, timeout=120.0) as client:
        existing = {a.get("name") for a in client.get("/v1/adapters").json().get("available") or []}
        for i, name in enumerate(names):
            if name in existing:
                continue
            archive = random_adapter_archive(model_path, name, rank, seed=1000 + i)
            resp = client.post("/v1/adapters/upload", data={"name": name},
                               files={"archive": (f"{name}.tar.gz", archive, "application/gzip")})
            if resp.status_code >= 400:
                remove_adapters(endpoint, uploaded)
                raise BenchError(f"{endpoint.name}: uploading adapter {name}: HTTP {resp.status_code}: {resp.text[:300]}")
            uploaded.append(name)
    return names, uploaded


def remove_adapters(endpoint: Endpoint, names: list[str]) -> list[str]:
    """Delete the named adapters from the server (a `--kiln-url` server is the user's own: the bench
    leaves it as it found it). Returns the names that could not be deleted."""
    left: list[str] = []
    with httpx.Client(base_url=endpoint.base_url, timeout=60.0) as client:
        for name in names:
            try:
                resp = client.delete(f"/v1/adapters/{name}")
            except httpx.HTTPError:
                left.append(name)
                continue
            if resp.status_code >= 400 and resp.status_code != 404:
                left.append(name)
    return left


def spread_over(prompts: list[BenchPrompt], adapters: list[str | None]) -> list[BenchPrompt]:
    """Prompt i asks for adapter i mod K; None asks for the base model explicitly (`adapter: null`)."""
    return [replace(p, extra={**p.extra, "adapter": adapters[i % len(adapters)]}) for i, p in enumerate(prompts)]
