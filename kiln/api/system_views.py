"""What the system routes answer (kiln.api.routers.system only parses, calls and serializes): /health
composed from the engine, adapter and training services (semantics.md §13.2), /v1/models (the base
model and every stored adapter, as vLLM lists LoRA modules), and /v1/config (the effective settings and
what is served, with content hashes).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from kiln import __version__
from kiln.api.auth import redacted_settings
from kiln.api.state import ServerState
from kiln.core.thinking_budget import ServerBudgetDefaults
from kiln.engine.serving import sampling_dict

if TYPE_CHECKING:
    from kiln.engine.view import EngineView

GB = 1024**3


def _gb(n: float) -> float:
    return round(n / GB, 4)


def _memory(engine: EngineView) -> dict[str, Any]:
    """Accelerator memory; on a CPU device there is no VRAM (total 0, fraction null) and the model and
    KV sizes are the host memory they occupy."""
    mem = engine.memory()
    model_b, kv_b = mem.model_bytes, mem.kv_cache_bytes
    total = 0
    if engine.info.device.startswith("cuda") and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.device(engine.info.device)).total_memory
    return {"total_vram_gb": _gb(total), "model_gb": _gb(model_b), "kv_cache_gb": _gb(kv_b),
            "training_budget_gb": 0.0,
            "inference_memory_fraction": round((model_b + kv_b) / total, 4) if total else None}


def _adapters(state: ServerState) -> tuple[str, int]:
    store = state.services.adapter_store
    try:
        count = len(store.names()) if store is not None else 0
    except OSError:
        count = 0
    return state.services.active_adapter_name() or "base", count


def _training(state: ServerState) -> dict[str, Any]:
    """§13.2 `training {active_job {job_id, progress}?, queued}`: active_job only while a job runs."""
    manager = state.services.training
    if manager is None:
        return {"queued": 0}
    summary = manager.active_summary()
    out: dict[str, Any] = {}
    if summary.get("active_job") is not None:
        out["active_job"] = summary["active_job"]
    out["queued"] = summary["queued"]
    return out


def _cpu_isa(engine: EngineView | None) -> str | None:
    """The kernels' ISA in use; None while the model loads or off the CPU."""
    return None if engine is None else (engine.cpu_kernels() or {}).get("isa")


def health_view(state: ServerState) -> tuple[dict[str, Any], int]:
    """The /health body and its status code: 200 when the model is loaded and the actor answers, else 503."""
    engine = state.engine
    loaded = engine is not None and state.load_error is None
    responsive = bool(loaded and engine.responsive())
    active, adapters_loaded = _adapters(state)
    body: dict[str, Any] = {
        "status": "ok" if loaded and responsive else "degraded",
        "version": __version__,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "model": engine.describe() if engine is not None else None,
        "backend": engine.backend if engine is not None else None,
        # the C++ kernels' instruction set in use (avx512 | avx2 | scalar; null: torch ops only)
        "cpu_isa": _cpu_isa(engine),
        "active_adapter": active,
        "adapters_loaded": adapters_loaded,
        "scheduler": engine.scheduler_snapshot() if engine is not None else
        {"waiting": 0, "running": 0, "blocks_used": 0, "blocks_free": 0, "blocks_total": 0},
        "gpu_memory": _memory(engine) if engine is not None else None,
        "training": _training(state),
        "checks": [
            {"name": "model_loaded", "pass": loaded},
            {"name": "scheduler_responsive", "pass": responsive},
            {"name": "inference_prewarm_complete", "pass": bool(engine is not None and engine.prewarmed)},
        ],
    }
    if state.load_error:
        body["error"] = state.load_error
    return body, 200 if loaded and responsive else 503


def models_view(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    data = []
    if engine is not None:
        base = engine.info.served_model_id
        data.append({"id": base, "object": "model", "created": engine.info.created, "owned_by": "kiln"})
        store = state.services.adapter_store
        # Adapters are models too (as vLLM lists LoRA modules): select one with `adapter`, or by id.
        for info in store.list() if store is not None else []:
            data.append({"id": info.name, "object": "model", "created": engine.info.created, "owned_by": "kiln",
                         "parent": base, "root": base})
    return {"object": "list", "data": data}


def config_view(state: ServerState) -> dict[str, Any]:
    """Settings after every layer (flags > env > TOML > defaults), the thinking-budget defaults, the
    sampling a request without sampling fields gets, and the content hashes of what is served."""
    settings = state.settings
    engine = state.engine
    body: dict[str, Any] = {
        "settings": redacted_settings(settings),
        "thinking_budget": ServerBudgetDefaults.from_settings(settings.server).to_dict(),
        "default_thinking_enabled": settings.server.default_thinking_enabled,
        "model": None,
        "default_sampling": None,
        "default_sampling_with_tools": None,
        "config_hashes": None,
        "effective_inference_config": None,
        "effective_config_hash": None,
    }
    if engine is not None:
        info = engine.info
        body["model"] = {
            "served_model_id": info.served_model_id, "path": info.path, "format": info.format,
            "architecture": info.config.architecture, "dtype": info.dtype, "device": info.device,
            # the weights the serving path multiplies with, "auto" resolved (none | gguf | gguf-float | ...)
            "quantization": info.quantization,
            "max_model_len": info.max_model_len, "num_blocks": info.num_blocks, "block_size": info.block_size,
            "backend": engine.backend,
            "cpu_isa": _cpu_isa(engine),
            "cpu_kernels": engine.cpu_kernels(),
            "base_model_sha256": engine.identity.base_model_sha256 if engine.identity else None,
        }
        body["default_sampling"] = sampling_dict(info.default_sampling(settings))
        body["default_sampling_with_tools"] = sampling_dict(info.default_sampling(settings, has_tools=True))
        body["config_hashes"] = engine.config_hashes()
        body["effective_inference_config"] = engine.effective_config
        body["effective_config_hash"] = engine.effective_config_sha256
    return body
