"""Build an engine from settings: load the weights and tokenizer, lay out the KV pool, size the
admission gate, start the actor (`build_engine`), and the helpers each of those steps reads."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

from kiln.config import Settings
from kiln.core.admission import AdmissionGate, gate_for
from kiln.core.decode_stats import DecodeWindow
from kiln.engine.actor import EngineActor
from kiln.engine.chat_template import ChatTemplate
from kiln.engine.provenance import base_model_sha256, serving_identity
from kiln.engine.runner import ModelRunner
from kiln.engine.serving import Engine, ModelInfo, effective_inference_config, resolved_itl_pacing
from kiln.engine.tokenizer import Tokenizer
from kiln.model import kernels
from kiln.model.config import ModelConfig
from kiln.model.kv_cache import KVCache
from kiln.model.loader import auto_quantization_reason, default_model_path, load_model

log = logging.getLogger("kiln.engine")
T = TypeVar("T")

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def _served_id(path: Path, explicit: str | None) -> str:
    if explicit:
        return explicit
    name = path.name
    for suffix in (".gguf",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _generation_defaults(path: Path) -> dict[str, Any]:
    gen = path / "generation_config.json" if path.is_dir() else None
    if gen is None or not gen.exists():
        return {}
    import json

    data = json.loads(gen.read_text())
    if data.get("do_sample") is False:
        return {"temperature": 0.0}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: data[k] for k in keys if isinstance(data.get(k), (int, float))}


def model_path(settings: Settings) -> Path:
    return Path(settings.model.path) if settings.model.path else default_model_path()


def torch_threads(settings: Settings, env: dict[str, str] | None = None) -> int:
    """engine.num_threads, else $KILN_NUM_THREADS; 0 keeps torch's default."""
    env = os.environ if env is None else env
    return settings.engine.num_threads or int(env.get("KILN_NUM_THREADS", "0") or 0)


# engine.kv_cache_memory_mb = 0: the pool holds as many tokens as this much bfloat16 K/V would
AUTO_KV_MEMORY_MB = 512


def kv_layout(settings: Settings, cfg: ModelConfig, kv_dtype: torch.dtype) -> tuple[int, int, int]:
    """(block size, blocks in the KV pool, context length) from engine.kv_cache_memory_mb and friends."""
    block_size = settings.engine.block_size
    memory_mb = settings.engine.kv_cache_memory_mb
    budget_mb, budget_dtype = (memory_mb, kv_dtype) if memory_mb else (AUTO_KV_MEMORY_MB, torch.bfloat16)
    num_blocks = max(4, budget_mb * 2**20 // KVCache.bytes_per_block(cfg, block_size, budget_dtype))
    max_len = min(cfg.max_position_embeddings, num_blocks * block_size)
    if settings.engine.max_model_len:
        max_len = min(max_len, settings.engine.max_model_len)
    return block_size, num_blocks, max_len


def decode_window(settings: Settings) -> DecodeWindow:
    """The rolling window of GET /v1/stats/decode ([stats] decode_window_secs), fed by the actor."""
    return DecodeWindow(settings.stats.decode_window_secs)


def build_engine(settings: Settings, *, start: bool = True, cancel: threading.Event | None = None) -> Engine:
    """Load everything; `start=False` leaves the actor for the caller to start. `cancel`, once set, stops
    the weights' load between tensors (kiln.model.gguf_loader.LoadCancelled)."""
    t0 = time.perf_counter()
    path = model_path(settings)
    device = resolve_device(settings.model.device)
    threads = torch_threads(settings)
    if threads > 0:
        torch.set_num_threads(threads)
    if device.type == "cpu":
        kernels.select_isa(settings.engine.cpu_isa)   # before dtype "auto" is resolved: it depends on it
    if device.type == "cpu" and kernels.enabled():
        # Built (or loaded from the cache) now, not mid-serving: every request runs the same code path.
        kernels.load()
    # a GGUF's tokenizer is built from its key/values on a thread of its own while the tensors load: its
    # Python (~0.1 s at a 50k vocabulary) runs while the packing holds no GIL
    tokenizing: list[Future[Tokenizer]] = []

    def tokenize(metadata: dict[str, Any]) -> None:
        tokenizing.append(_in_background("kiln-tokenizer", None, Tokenizer.from_gguf_metadata, metadata))

    try:
        model, weights = load_model(str(path), dtype=settings.model.dtype, device=device,
                                    quantization=settings.model.quantization, cancel=cancel, on_metadata=tokenize)
    finally:
        # (a thread must not be left running when a failed load ends the process)
        futures.wait(tokenizing)
    if tokenizing:
        tokenizer = tokenizing[0].result()
    elif weights.format == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(weights.gguf_metadata or {})
    else:
        tokenizer = Tokenizer.from_hf_dir(path)
    if not tokenizer.chat_template:
        raise ValueError(
            f"the model at {path} has no chat template (tokenizer_config.json 'chat_template', "
            "chat_template.jinja, or GGUF tokenizer.chat_template); Kiln serves chat models only"
        )
    template = ChatTemplate(tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    cfg = model.config
    kv_dtype = next(model.parameters()).dtype
    block_size, num_blocks, max_len = kv_layout(settings, cfg, kv_dtype)
    runner = ModelRunner(model, num_blocks, block_size, device, kv_dtype)
    info = ModelInfo(
        path=str(path), served_model_id=_served_id(path, settings.model.served_model_id), config=cfg,
        format=weights.format, dtype=str(kv_dtype).removeprefix("torch."), device=str(device),
        max_model_len=max_len, num_blocks=num_blocks, block_size=block_size, created=int(time.time()),
        generation_defaults=_generation_defaults(path), quantization=weights.quantization,
    )
    actor = EngineActor(runner, tokenizer, block_size=block_size, num_blocks=num_blocks,
                      max_num_seqs=settings.engine.max_num_seqs,
                      max_batch_tokens=settings.engine.max_batch_tokens,
                      enable_prefix_caching=settings.engine.enable_prefix_caching,
                      prefill_cost_with_decodes=settings.engine.prefill_cost_with_decodes,
                      itl_pacing=resolved_itl_pacing(settings, info),
                      decode_stats=decode_window(settings))
    # the weights' hash now (from its cache beside them: a stat and a small read; a new file is hashed
    # whole, once); the rest of the identity (the tokenizer's canonical JSON, ~0.3 s of Python at a 50k
    # vocabulary) once the engine has warmed up: before, it would hold the GIL the rest of the start needs
    base_sha256 = base_model_sha256(path, settings.data.data_dir)
    after = actor.warm_up_done if start else None   # (no warm-up to wait for)
    identity = _in_background("kiln-identity", after, serving_identity, path, settings.data.data_dir,
                              tokenizer, tokenizer.chat_template, cfg, base_sha256)
    if start:
        actor.start()
    log.info("loaded %s from %s (%s, %s on %s%s, quantization %s) in %.1fs; KV pool %d blocks x %d tokens, "
             "context %d; weights %s", info.describe(), path, weights.format, info.dtype, device,
             f", kernels {kernels.active_isa()}" if device.type == "cpu" and kernels.enabled() else "",
             info.quantization, time.perf_counter() - t0, num_blocks, block_size, max_len, base_sha256)
    if weights.served:
        log.info("weights served: %s", weights.served)
    if weights.held:
        log.info("weights held in memory: %s", weights.held)
    if settings.model.quantization == "auto" and device.type == "cpu" and weights.format == "gguf":
        reason = auto_quantization_reason(path, device)
        if reason:
            log.info("weights: %s", reason)
    engine = Engine(info, tokenizer, template, actor, weights, identity,
                    effective_inference_config(settings, info, runner.backend))
    engine.admission = admission_gate(settings, num_blocks * block_size, max_len)
    log.info("admission: at most %d waiting requests and %d queued prompt tokens (then 429 + Retry-After)",
             engine.admission.max_waiting_requests, engine.admission.max_queued_tokens)
    return engine


def _in_background(name: str, after: threading.Event | None, fn: Callable[..., T], *args: Any,
                   wait_s: float = 30.0) -> Future[T]:
    """`fn(*args)` on a daemon thread of its own, once `after` is set (or `wait_s` has passed) when given;
    its result (or exception) through the future. A reader of the future waits for both."""
    future: Future[T] = Future()

    def run() -> None:
        if after is not None:
            after.wait(wait_s)
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the result
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def admission_gate(settings: Settings, kv_pool_tokens: int, max_model_len: int) -> AdmissionGate:
    e = settings.engine
    return gate_for(e.max_waiting_requests, e.max_queued_prompt_tokens, max_num_seqs=e.max_num_seqs,
                    kv_pool_tokens=kv_pool_tokens, max_model_len=max_model_len)
