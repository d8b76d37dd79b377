"""The engines a benchmark drives, behind one interface; Kiln is measured through its HTTP server."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import kiln
from kiln.bench import client_load
from kiln.bench.client_load import Endpoint, ItlRun, LoadRun, StreamRecord
from kiln.bench.prompts import BenchPrompt
from kiln.bench.results import KILN
from kiln.bench.servers import ServerProcess, free_port


class Unsupported(Exception):
    """This engine cannot run this measurement here (a missing optional part): noted, not a failure."""


@dataclass
class SingleRun:
    prompt_tokens: int
    ttft_s: float
    completion_tokens: int
    decode_tps: float | None

    @property
    def prefill_tps(self) -> float | None:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else None

    @classmethod
    def from_stream(cls, rec: StreamRecord) -> SingleRun:
        return cls(prompt_tokens=rec.prompt_tokens or 0, ttft_s=rec.ttft or 0.0,
                   completion_tokens=rec.num_tokens, decode_tps=rec.decode_tps)


class BenchEngine:
    """Subclasses implement `single` and `load`; `start`, `close` and `itl` are optional."""

    name: str
    # Kiln-only measurements (adapters, training) run on the primary Kiln server of each ISA
    primary = False

    def start(self) -> None:
        """Load weights / start processes. Called once before the first measurement."""

    def close(self) -> None:
        """Release processes and memory. Called once at the end, also after a failure."""

    def _stop_server(self) -> None:
        """Stop the server process this engine started (`self.server`) and remove its scratch folder."""
        server, tmp = getattr(self, "server", None), getattr(self, "_tmp", None)
        if server is not None:
            server.stop()
            self.server = None
        if tmp is not None:
            tmp.cleanup()
            self._tmp = None

    def warmup(self, prompt: BenchPrompt) -> None:
        self.single(prompt, 8)

    def single(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        raise NotImplementedError

    def load(self, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int) -> LoadRun:
        raise NotImplementedError

    def itl(self, stream_prompts: Sequence[BenchPrompt], long_prompt: BenchPrompt, max_tokens: int,
            trigger_tokens: int) -> ItlRun | None:
        """None: this engine has no way to serve streams while a prompt arrives."""
        return None


class HttpEngine(BenchEngine):
    """Any OpenAI-compatible streaming server."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.name = endpoint.name
        self.endpoint = endpoint

    def single(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        return SingleRun.from_stream(asyncio.run(client_load.single_stream(self.endpoint, prompt, max_tokens)))

    def load(self, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int) -> LoadRun:
        return asyncio.run(client_load.concurrent_streams(self.endpoint, prompts, concurrency, max_tokens))

    def itl(self, stream_prompts: Sequence[BenchPrompt], long_prompt: BenchPrompt, max_tokens: int,
            trigger_tokens: int) -> ItlRun | None:
        return asyncio.run(client_load.streams_with_long_arrival(
            self.endpoint, stream_prompts, long_prompt, max_tokens, trigger_tokens))


def _pythonpath_with_kiln() -> str:
    """The child runs in a scratch directory: make this very `kiln` importable there, installed or not."""
    root = str(Path(kiln.__file__).resolve().parent.parent)
    rest = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + rest if rest else "")


# What an AVX2-only CPU runs, forced on a CPU that has more: Kiln's kernels, and torch's own (ATen,
# oneDNN, MKL) for the ops that are not Kiln's (training's autograd, prefill attention).
AVX2_ENV = {"KILN_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


class KilnServerEngine(HttpEngine):
    """`python -m kiln.cli serve` in a child process, exactly as a user runs it. `isa` "avx2" forces
    the AVX2 code paths on a CPU that has AVX-512 (None: the CPU's best, as `make serve` runs)."""

    def __init__(self, model_path: str, threads: int, kv_cache_mb: int | None = None,
                 url: str | None = None, quantization: str = "auto", name: str = KILN,
                 isa: str | None = None, primary: bool = True) -> None:
        super().__init__(Endpoint(name, url or "", extra_body={"ignore_eos": True}))
        self.model_path, self.threads, self.kv_cache_mb = model_path, threads, kv_cache_mb
        self.quantization, self.isa, self.primary = quantization, isa, primary
        self.server: ServerProcess | None = None
        self.cpu_isa: str | None = None     # what the server reports in /health
        self.weights: str | None = None     # the quantization it resolved, from its /v1/config
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> None:
        if not self.endpoint.base_url:
            self._tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-")
            tmp = Path(self._tmp.name)
            port = free_port()
            env = {"KILN_ENGINE_NUM_THREADS": str(self.threads), "PYTHONPATH": _pythonpath_with_kiln()}
            if self.kv_cache_mb:
                env["KILN_ENGINE_KV_CACHE_MEMORY_MB"] = str(self.kv_cache_mb)
            if self.isa == "avx2":
                env.update(AVX2_ENV)
            elif self.isa:
                env["KILN_CPU_ISA"] = self.isa
            args = [sys.executable, "-m", "kiln.cli", "serve", "--model", self.model_path, "--port", str(port),
                    "--data-dir", str(tmp / "data"), "--log-level", "warning", "--quantization", self.quantization]
            self.server = ServerProcess(self.name, args, port, tmp / "kiln-serve.log", "/health", env=env,
                                        cwd=tmp).start()
            self.endpoint.base_url = self.server.url
        self.endpoint.model = asyncio.run(client_load.discover_model(self.endpoint))
        self.cpu_isa = asyncio.run(client_load.health_field(self.endpoint, "cpu_isa"))
        self.weights = asyncio.run(client_load.config_model_field(self.endpoint, "quantization"))

    def close(self) -> None:
        self._stop_server()
