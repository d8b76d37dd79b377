"""The eval Generator over the in-process serving engine (kiln.evals.generator.Generator).

Each request becomes the chat request it is (`chat_input`) and goes through the same preparation
(`kiln.engine.chat_request.prepare_chat`) and generation (`chat_response.collect`) as POST
/v1/chat/completions. All requests of a batch are submitted together so the engine schedules them in
the same steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln import __version__
from kiln.config import ServerSettings
from kiln.core.thinking_budget import ServerBudgetDefaults, resolve_budget
from kiln.engine.chat_request import AdapterSelection, ChatInput, PreparedChat, prepare_chat, resolve_adapter
from kiln.engine.chat_response import collect
from kiln.engine.lora_slots import AdapterTarget
from kiln.engine.serving import Engine
from kiln.errors import KilnError
from kiln.evals.generator import GenerationRequest, GenerationResult, GeneratorIdentity
from kiln.store.hashing import sha256_file, sha256_tagged

CODE = "eval_invalid_request"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
_NO_BUDGET = resolve_budget({}, ServerBudgetDefaults())
# An eval's GenerationParams fix every sampling field: what it does not name is neutral, never a preset's
# or the model's generation_config default.
_NEUTRAL_SAMPLING = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def chat_input(req: GenerationRequest) -> ChatInput:
    """The chat request an eval generation request is: the same preparation, the same engine work."""
    return ChatInput(
        messages=req.messages, tools=list(req.tools) or None,
        sampling={**_NEUTRAL_SAMPLING, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                  "max_tokens": req.max_tokens, "seed": req.seed},
        stop=list(req.stop), chat_template_kwargs=req.chat_template_kwargs,
        budget=req.thinking_budget or _NO_BUDGET,
        # adapter None is the base model, never the server's active default
        adapter=AdapterSelection(adapter=req.adapter, adapter_given=True),
        stop_after_tool_call=False, code=CODE,
    )


class LocalEngineGenerator:
    def __init__(self, engine: Engine, server: ServerSettings) -> None:
        self.engine = engine
        self.server = server
        self._identity: GeneratorIdentity | None = None

    # -- Generator ------------------------------------------------------------------------------------
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        # gather starts every request before any awaits, so the engine sees them together.
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def identity(self) -> GeneratorIdentity:
        if self._identity is None:
            manifest = await asyncio.to_thread(base_weight_manifest, Path(self.engine.info.path),
                                               self.engine.info.format)
            self._identity = GeneratorIdentity(self.execution_provenance(), manifest,
                                               ServerBudgetDefaults.from_settings(self.server))
        return self._identity

    # -- one request ----------------------------------------------------------------------------------
    def prepare(self, req: GenerationRequest, target: AdapterTarget | None) -> PreparedChat:
        request_id = f"eval-{req.label or 'request'}-{uuid.uuid4().hex[:8]}"
        return prepare_chat(self.engine.prompt_context(), chat_input(req), self.server, request_id=request_id, target=target)

    async def _one(self, req: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        inp = chat_input(req)
        try:
            target = resolve_adapter(self.engine.prompt_context(), inp.adapter)
        except KilnError as e:
            return GenerationResult.failed(f"adapter {req.adapter!r} cannot be applied: {e.message}")
        try:
            # Rendering and tokenizing thousands of prompts must not stall the server's event loop.
            prep = await asyncio.to_thread(self.prepare, req, target)
        except KilnError as e:
            return GenerationResult.failed(f"prepare failed: {e.message}")
        except Exception as e:  # noqa: BLE001 - a template that raises fails this example only
            return GenerationResult.failed(f"prepare failed: {type(e).__name__}: {e}")
        try:
            (out,) = await collect(self.engine, prep)
        except KilnError as e:
            return GenerationResult.failed(e.message, latency_ms=_ms_since(started),
                                           prompt_tokens=len(prep.prompt_ids))
        record = prep.budget_record(out.outcome if prep.budget_applies else None)
        return GenerationResult(text=out.text, prompt_tokens=len(prep.prompt_ids),
                                completion_tokens=len(out.token_ids), latency_ms=_ms_since(started),
                                finish_reason=out.finish_reason, thinking_budget=record,
                                prompt_starts_in_reasoning=prep.thinking_enabled)

    # -- identity -------------------------------------------------------------------------------------
    def execution_provenance(self) -> dict[str, Any]:
        """What shapes the bytes a seeded run produces, apart from the weights themselves."""
        info, tokenizer = self.engine.info, self.engine.tokenizer
        return {
            "schema": "kiln.execution-provenance.v1",
            "engine": "kiln",
            "kiln_version": __version__,
            "torch_version": torch.__version__,
            "device": info.device,
            "dtype": info.dtype,
            "architecture": info.config.architecture,
            "served_model_id": info.served_model_id,
            "max_model_len": info.max_model_len,
            "tokenizer_sha256": sha256_tagged(tokenizer.backend.to_str().encode("utf-8")),
            "chat_template_sha256": sha256_tagged((tokenizer.chat_template or "").encode("utf-8")),
            "default_thinking_enabled": self.server.default_thinking_enabled,
        }


def base_weight_manifest(path: Path, fmt: str) -> dict[str, Any]:
    """Every weight file (and the config) with its size and SHA-256: the base model's byte identity."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
    else:
        files = [path]
    return {
        "schema": "kiln.base-weight-manifest.v1",
        "format": fmt,
        "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": "sha256:" + sha256_file(p)} for p in files],
    }


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0
