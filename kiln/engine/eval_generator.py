"""The eval Generator over the in-process serving engine (kiln.evals.generator.Generator).

Each request is rendered with the model's chat template, sampled with its own seed and, when a
thinking budget applies, driven by a budget controller, exactly as a chat request would be. All
requests of a batch are submitted together so the engine schedules them in the same steps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln import __version__
from kiln.config import ServerSettings
from kiln.core.budget_controller import ThinkingBudgetController
from kiln.core.sampling import SamplingParams, validate_sampling
from kiln.core.thinking_budget import (
    EffectiveBudget,
    ServerBudgetDefaults,
    budget_record,
    check_budget_request,
    resolve_budget,
)
from kiln.core.thinking_mode import detect_thinking_mode, effective_template_kwargs
from kiln.engine.serving import ServingEngine
from kiln.errors import KilnError
from kiln.evals.generator import GenerationRequest, GenerationResult, GeneratorIdentity
from kiln.store.hashing import sha256_file, sha256_tagged

CODE = "eval_invalid_request"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
_NO_BUDGET = resolve_budget({}, ServerBudgetDefaults())


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    budget: EffectiveBudget
    applies: bool
    controllers: list[ThinkingBudgetController | None] | None
    thinking: bool


class LocalEngineGenerator:
    def __init__(self, engine: ServingEngine, server: ServerSettings) -> None:
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
    def _prepare(self, req: GenerationRequest) -> _Prepared:
        engine = self.engine
        kwargs = effective_template_kwargs(req.chat_template_kwargs,
                                           default_thinking_enabled=self.server.default_thinking_enabled)
        prompt = engine.render_chat(req.messages, tools=req.tools or None, template_kwargs=kwargs)
        ids = engine.encode_prompt(prompt)
        ceiling = engine.info.max_model_len
        if len(ids) >= ceiling:
            raise KilnError(400, "context_length_exceeded",
                            f"the prompt has {len(ids)} tokens; this model's context is {ceiling}")
        base = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              max_tokens=min(req.max_tokens, ceiling - len(ids)), stop=list(req.stop), seed=req.seed)
        validate_sampling(base, code=CODE)
        params = engine.choice_params(base, 1)[0]
        thinking = detect_thinking_mode(prompt).thinking_enabled
        budget = req.thinking_budget or _NO_BUDGET
        close_ids = engine.close_think_ids
        applies = check_budget_request(budget, thinking_enabled=thinking, max_tokens=params.max_tokens,
                                       stops=req.stop, close_ids=close_ids,
                                       close_decoded=engine.tokenizer.decode(close_ids), code=CODE)
        controllers: list[ThinkingBudgetController | None] | None = None
        if applies:
            controllers = [ThinkingBudgetController(close_ids, max_thinking_tokens=budget.max_tokens,
                                                    max_time_ms=budget.max_time_ms,
                                                    max_completion_tokens=params.max_tokens)]
        return _Prepared(ids, params, budget, applies, controllers, thinking)

    async def _one(self, req: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        try:
            target = self.engine.resolve_adapter(adapter_given=True, adapter=req.adapter, adapters=None) \
                if req.adapter else None
        except KilnError as e:
            return GenerationResult.failed(f"adapter {req.adapter!r} cannot be applied: {e.message}")
        try:
            # Rendering and tokenizing thousands of prompts must not stall the server's event loop.
            prep = await asyncio.to_thread(self._prepare, req)
        except KilnError as e:
            return GenerationResult.failed(f"prepare failed: {e.message}")
        except Exception as e:  # noqa: BLE001 - a template that raises fails this example only
            return GenerationResult.failed(f"prepare failed: {type(e).__name__}: {e}")
        text, tokens, finish, outcome = "", 0, "stop", None
        request_id = f"eval-{req.label or 'request'}-{uuid.uuid4().hex[:8]}"
        async for ev in self.engine.generate(prep.prompt_ids, [prep.params], request_id, prep.controllers,
                                            target):
            if ev.error:
                return GenerationResult.failed(f"generation failed: {ev.error}",
                                               latency_ms=_ms_since(started), prompt_tokens=len(prep.prompt_ids))
            text += ev.text
            tokens += len(ev.token_ids)
            if ev.finish_reason:
                finish, outcome = ev.finish_reason, ev.budget_outcome
        record = budget_record(prep.budget, applied=prep.applies, outcome=outcome if prep.applies else None)
        return GenerationResult(text=text, prompt_tokens=len(prep.prompt_ids), completion_tokens=tokens,
                                latency_ms=_ms_since(started), finish_reason=finish, thinking_budget=record,
                                prompt_starts_in_reasoning=prep.thinking)

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
