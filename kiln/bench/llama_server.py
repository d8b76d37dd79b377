"""Reference: llama.cpp's own server, `llama-server` (continuous batching over `-np` slots), on the
same GGUF, driven over HTTP exactly like Kiln's server.

The binary comes from `--llama-server PATH` (or `$KILN_LLAMA_SERVER`), else `llama-server` on PATH,
else the cache of the build script (`~/.cache/kiln-llama-server/.../build-<isa>/bin/llama-server`; for
the machine's own ISA an `ISA=avx512` build is taken before the native one on an AVX-512 CPU, and an
`ISA=avx2` build after it on a CPU whose best is AVX2),
else the build script itself when one is named (`--build-llama-server SCRIPT` or
`$KILN_BUILD_LLAMA_SERVER`, run as `ISA=native|avx2 SCRIPT`, printing the binary's path last). The
AVX2 build has its own flag and variable (`--llama-server-avx2`, `$KILN_LLAMA_SERVER_AVX2`) and is
never taken from PATH, whose binary is built for the machine's own CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.bench.client_load import Endpoint
from kiln.bench.engines import HttpEngine
from kiln.bench.servers import ServerProcess, free_port

BINARY = "llama-server"
ENV = {"native": "KILN_LLAMA_SERVER", "avx2": "KILN_LLAMA_SERVER_AVX2"}
BUILD_ENV = "KILN_BUILD_LLAMA_SERVER"
SLOTS = 64                 # -np: as many parallel sequences as the largest concurrency measured
CONTEXT = 131072           # -c: 2048 tokens per slot, room for the 2000-token prompt


def cache_root() -> Path:
    """Where the build script keeps its builds (its LLAMA_SERVER_CACHE / XDG_CACHE_HOME rules)."""
    if os.environ.get("LLAMA_SERVER_CACHE"):
        return Path(os.environ["LLAMA_SERVER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln-llama-server"


def cached_binary(isa: str, root: Path | None = None) -> Path | None:
    found = sorted((root or cache_root()).glob(f"*/vendor/llama.cpp/build-{isa}/bin/{BINARY}"))
    return next((p for p in reversed(found) if os.access(p, os.X_OK)), None)


@dataclass(frozen=True)
class Located:
    path: str | None
    how: str               # where it was found, or why there is none


def native_builds(best: str) -> tuple[str, ...]:
    """The cached builds that serve as the machine's own ISA, best first, for a CPU whose widest ISA
    Kiln's kernels run is `best`. On AVX-512 an explicit ISA=avx512 build (no AMX) comes first: the
    -march=native build died with SIGSEGV at startup on an Intel Xeon with AMX. On an AVX2-only CPU
    the ISA=avx2 build is that CPU's own (an avx512 one would not run there)."""
    return ("avx512", "native") if best == "avx512" else ("native", best)


def locate(isa: str, explicit: str | None = None, build_script: str | None = None,
           best: str = "avx512") -> Located:
    """The llama-server binary for `isa` ("native": the machine's own ISA, whose widest is `best`; or
    "avx2")."""
    explicit = explicit or os.environ.get(ENV[isa])
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return Located(explicit, "given")
        return Located(None, f"{explicit} is not an executable file")
    on_path = shutil.which(BINARY) if isa == "native" else None
    if on_path:
        return Located(on_path, "on PATH")
    for build in (native_builds(best) if isa == "native" else (isa,)):
        cached = cached_binary(build)
        if cached is not None:
            return Located(str(cached), f"built earlier by the build script (cache, ISA={build})")
    script = build_script or os.environ.get(BUILD_ENV)
    if script:
        return run_build_script(isa, script)
    flag = "--llama-server" if isa == "native" else "--llama-server-avx2"
    return Located(None, f"no {BINARY} ({isa}) found: pass {flag} PATH, put {BINARY} on PATH, or name the "
                         "build script with --build-llama-server (e.g. the repo's tools/build-llama-server)")


def run_build_script(isa: str, script: str) -> Located:
    if not Path(script).is_file():
        return Located(None, f"build script {script} does not exist")
    proc = subprocess.run([script], env={**os.environ, "ISA": isa}, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        return Located(None, f"{script} (ISA={isa}) failed with {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return Located(lines[-1], f"built by {script}")


def version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line.strip() for line in text if line.startswith("version")), text[0] if text else "unknown")


class LlamaServerEngine(HttpEngine):
    """`llama-server -m GGUF -t N -np 64 -c 131072` on a loopback port; EOS ignored per request."""

    reference = True

    def __init__(self, name: str, binary: str, model_path: str, threads: int, isa: str,
                 slots: int = SLOTS, context: int = CONTEXT) -> None:
        super().__init__(Endpoint(name, "", extra_body={"ignore_eos": True}))
        self.binary, self.model_path, self.threads, self.isa = binary, model_path, threads, isa
        self.slots, self.context = slots, context
        self.server: ServerProcess | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def args(self, port: int) -> list[str]:
        t = str(self.threads)
        return [self.binary, "-m", self.model_path, "-t", t, "-tb", t, "-np", str(self.slots), "-c", str(self.context),
                "--host", "127.0.0.1", "--port", str(port)]

    def start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-llama-server-")
        port = free_port()
        self.server = ServerProcess(self.name, self.args(port), port, Path(self._tmp.name) / "llama-server.log",
                                    "/health").start()
        self.endpoint.base_url = self.server.url

    def close(self) -> None:
        self._stop_server()
