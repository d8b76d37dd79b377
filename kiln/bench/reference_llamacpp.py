"""Reference: llama.cpp through `llama-cpp-python` (the optional `llamacpp` extra), on the same GGUF.

Single stream uses its `Llama` class in this process; concurrent streams and the long-prompt case go
through its OpenAI-compatible server (`python -m llama_cpp.server`), the way a user would serve it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.bench.client_load import Endpoint, ItlRun, LoadRun
from kiln.bench.engines import BenchEngine, HttpEngine, SingleRun, Unsupported
from kiln.bench.prompts import BenchPrompt
from kiln.bench.results import LLAMACPP
from kiln.bench.servers import ServerProcess, free_port

INSTALL_HINT = "pip install 'kiln[llamacpp]' (builds llama.cpp from source: needs cmake and a C++ compiler)"
# What `python -m llama_cpp.server` imports beyond llama_cpp itself (the `server` extra).
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


def llamacpp_status() -> tuple[bool, str]:
    """(importable, version or the reason it is not)."""
    try:
        module = importlib.import_module("llama_cpp")
    except ImportError as e:
        return False, f"llama-cpp-python is not installed ({e.name or e})"
    except OSError as e:   # the package is there but its shared library does not load
        return False, f"llama-cpp-python does not load: {e}"
    return True, str(getattr(module, "__version__", "unknown"))


def llamacpp_server_missing() -> list[str]:
    """Modules its OpenAI server needs that are not installed."""
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


class LlamaCppEngine(BenchEngine):
    name = LLAMACPP

    def __init__(self, model_path: str, threads: int, eos_token_ids: Sequence[int], n_ctx: int = 4096) -> None:
        if Path(model_path).suffix != ".gguf":
            raise ValueError("llama.cpp needs a .gguf model file")
        self.model_path, self.threads, self.n_ctx = model_path, threads, n_ctx
        # Large negative bias on EOS: the OpenAI-style ignore_eos that its server understands.
        self.endpoint = Endpoint(LLAMACPP, "", extra_body={"logit_bias": {str(t): -100.0 for t in eos_token_ids}})
        self.llm: Any = None
        self.server: ServerProcess | None = None
        self._http: HttpEngine | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._warmup_prompt: BenchPrompt | None = None

    # The in-process model and the server are each started on first use, and only one runs at a time.
    def _model(self) -> Any:
        if self.llm is None:
            from llama_cpp import Llama

            self.llm = Llama(model_path=self.model_path, n_ctx=self.n_ctx, n_threads=self.threads,
                             n_threads_batch=self.threads, verbose=False)
            if self._warmup_prompt is not None:
                self._generate(self._warmup_prompt, 8)
        return self.llm

    def _server(self) -> HttpEngine:
        if self._http is None:
            missing = llamacpp_server_missing()
            if missing:
                raise Unsupported(f"its server needs {', '.join(missing)}: pip install 'llama-cpp-python[server]'")
            self.llm = None
            self._tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-llamacpp-")
            port = free_port()
            args = [sys.executable, "-m", "llama_cpp.server", "--model", self.model_path, "--host", "127.0.0.1",
                    "--port", str(port), "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                    "--n_ctx", str(self.n_ctx),
                    # by default a new request interrupts the one streaming: that is not serving N streams
                    "--interrupt_requests", "False"]
            self.server = ServerProcess("llama.cpp", args, port, Path(self._tmp.name) / "llama-server.log",
                                        "/v1/models").start()
            self.endpoint.base_url = self.server.url
            self._http = HttpEngine(self.endpoint)
            if self._warmup_prompt is not None:
                self._http.warmup(self._warmup_prompt)
        return self._http

    def close(self) -> None:
        self.llm = None
        self._stop_server()
        self._http = None

    def single(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        self._model()
        return self._generate(prompt, max_tokens)

    def _generate(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        llm = self.llm
        llm.reset()   # no reuse of the previous prompt's KV: every prompt is prefilled in full
        times: list[float] = []
        start = time.perf_counter()
        # generate() yields sampled tokens forever and never checks EOS itself: that is ignore_eos.
        for _ in llm.generate(prompt.prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
            times.append(time.perf_counter())
            if len(times) >= max_tokens:
                break
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return SingleRun(prompt_tokens=prompt.num_tokens, ttft_s=times[0] - start, completion_tokens=len(times),
                         decode_tps=(len(times) - 1) / span if span > 0 else None)

    def load(self, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int) -> LoadRun:
        return self._server().load(prompts, concurrency, max_tokens)

    def itl(self, stream_prompts: Sequence[BenchPrompt], long_prompt: BenchPrompt, max_tokens: int,
            trigger_tokens: int) -> ItlRun | None:
        return self._server().itl(stream_prompts, long_prompt, max_tokens, trigger_tokens)

    def warmup(self, prompt: BenchPrompt) -> None:
        # Remembered, not run: the model and the server each warm up when first started.
        self._warmup_prompt = prompt
