"""`kiln bench --synthetic SIZE[:TYPE]`: a random-weight GGUF with a real model's shapes, made once and
cached, so the bench measures at real sizes without downloading weights.

The F16 file is written by `kiln.bench.synthetic_gguf` (SIZE's body, the embedded tokenizer), then
llama.cpp's own `llama-quantize` turns it into TYPE (q4_k_m by default; q5_k_m, q6_k, q8_0, iq4_xs, iq4_nl), with
llama.cpp's per-tensor choices, exactly as a downloaded file was made. Both files are kept in the cache
directory ($KILN_BENCH_MODELS, else ~/.cache/kiln/bench-models), each written under a temp name and
renamed when complete (a killed run never leaves a file that looks finished). A file's name carries a
hash of the generator's source, so a changed generator writes new files (and removes its stale ones).

llama-quantize is taken from $KILN_LLAMA_QUANTIZE, else beside the llama-server the bench uses (the
build script builds both), else from PATH, else from the build script's cache (its llama-server builds,
then `tools/build-llamacpp quantize`'s kiln-llama-quantize: the same llama_model_quantize call, built
on libllama alone).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.bench import llama_server
from kiln.bench.synthetic_gguf import BODIES, write_synthetic_gguf
from kiln.errors import KilnError
from kiln.store.atomic import atomic_path

ENV_DIR = "KILN_BENCH_MODELS"
ENV_QUANTIZE = "KILN_LLAMA_QUANTIZE"
BINARY = "llama-quantize"
HARNESS = "kiln-llama-quantize"
# --synthetic's TYPE -> llama-quantize's type name; f16 is the generator's own file, never quantized
QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0", "iq4_xs": "IQ4_XS",
               "iq4_nl": "IQ4_NL"}
TYPES = ("f16", *QUANT_TYPES)
DEFAULT_TYPE = "q4_k_m"
BUILD_HINT = ("Build it with the repo's tools/build-llama-server (llama-server and llama-quantize, ~10 min on "
              "2 cores), or pass --build-llama-server tools/build-llama-server, or build only the quantizer "
              "with tools/build-llamacpp quantize (~2 min); or set KILN_LLAMA_QUANTIZE=/path/to/llama-quantize.")


@dataclass(frozen=True)
class SyntheticSpec:
    size: str
    type: str = DEFAULT_TYPE

    @classmethod
    def parse(cls, text: str) -> SyntheticSpec:
        """`SIZE[:TYPE]`, e.g. `1b` or `3b:q6_k` (case-insensitive)."""
        size, colon, kind = text.strip().lower().partition(":")
        kind = kind if colon else DEFAULT_TYPE
        if size not in BODIES or kind not in TYPES:
            raise KilnError(400, "invalid_synthetic", f"--synthetic takes SIZE[:TYPE]; got {text!r}",
                            param="synthetic", hint=f"SIZE: {', '.join(BODIES)}; TYPE: {', '.join(TYPES)} "
                            f"(default {DEFAULT_TYPE}); e.g. --synthetic 1b or --synthetic 3b:q6_k")
        return cls(size, kind)

    def describe(self) -> str:
        how = "F16" if self.type == "f16" else f"{QUANT_TYPES[self.type]} made by llama-quantize from F16"
        return f"synthetic {self.size} body, random weights, {how}"


def cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "bench-models"


def generator_stamp() -> str:
    """8 hex digits of the generator's source: a changed generator is a different file."""
    from kiln.bench import synthetic_gguf

    return hashlib.sha256(Path(synthetic_gguf.__file__).read_bytes()).hexdigest()[:8]


def file_name(size: str, kind: str, stamp: str | None = None) -> str:
    return f"kiln-synthetic-{size}-{kind}-{stamp or generator_stamp()}.gguf"


def locate_quantize(llama_server_binary: str | None = None, root: Path | None = None) -> llama_server.Located:
    """llama-quantize (or its plain form, kiln-llama-quantize): see the module docstring for the order."""
    explicit = os.environ.get(ENV_QUANTIZE)
    if explicit:
        if _executable(Path(explicit)):
            return llama_server.Located(explicit, f"${ENV_QUANTIZE}")
        return llama_server.Located(None, f"${ENV_QUANTIZE}={explicit} is not an executable file")
    if llama_server_binary:
        beside = Path(llama_server_binary).parent / BINARY
        if _executable(beside):
            return llama_server.Located(str(beside), f"beside {llama_server_binary}")
    on_path = shutil.which(BINARY)
    if on_path:
        return llama_server.Located(on_path, "on PATH")
    root = root or llama_server.cache_root()
    for pattern in (f"*/vendor/llama.cpp/build-*/bin/{BINARY}", f"*/vendor/llama.cpp/build-lib-*/bin/{HARNESS}"):
        found = [p for p in sorted(root.glob(pattern)) if _executable(p)]
        if found:
            return llama_server.Located(str(found[-1]), "built earlier by the build script (cache)")
    return llama_server.Located(None, f"no {BINARY} found (beside llama-server, on PATH, or in {root})")


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def prepare(spec: SyntheticSpec, find_quantize: Callable[[], str | None], directory: Path | None = None,
            threads: int = 0, log: Callable[[str], None] = print) -> Path:
    """The cached GGUF for `spec`, written first where missing: the F16 file by the generator, the TYPE
    file from it by llama-quantize, whose path `find_quantize` gives (called only when the TYPE file is
    missing, so a cached file needs no llama.cpp build)."""
    directory = directory or cache_dir()
    f16 = directory / file_name(spec.size, "f16")
    if not f16.exists():
        _remove_stale(directory, spec.size, "f16")
        log(f"writing the synthetic {spec.size} F16 GGUF to {f16}")
        with atomic_path(f16) as tmp:
            write_synthetic_gguf(tmp, spec.size, "f16")
    if spec.type == "f16":
        return f16
    out = directory / file_name(spec.size, spec.type)
    if out.exists():
        return out
    quantize = find_quantize()
    if quantize is None:
        raise KilnError(400, "llama_quantize_not_found",
                        f"--synthetic {spec.size}:{spec.type} needs llama.cpp's {BINARY} to make the "
                        f"{QUANT_TYPES[spec.type]} file from the F16 one, and none was found",
                        param="synthetic", hint=BUILD_HINT)
    _remove_stale(directory, spec.size, spec.type)
    log(f"quantizing it to {QUANT_TYPES[spec.type]} with {quantize}: {out}")
    with atomic_path(out) as tmp:
        args = [quantize, str(f16), str(tmp), QUANT_TYPES[spec.type]] + ([str(threads)] if threads > 0 else [])
        proc = subprocess.run(args, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-500:]
            raise KilnError(500, "llama_quantize_failed",
                            f"{quantize} failed with exit code {proc.returncode}: {tail}", param="synthetic",
                            hint=f"the F16 file {f16} is kept; run the command by hand to see its full output")
    return out


def _remove_stale(directory: Path, size: str, kind: str) -> None:
    """Files of the same size and type that an earlier generator wrote (their stamp differs), and what
    a server kept beside them (its `.kiln-identity.json`)."""
    current = file_name(size, kind)
    for old in directory.glob(f"kiln-synthetic-{size}-{kind}-*.gguf*"):
        if not old.name.startswith(current):
            old.unlink(missing_ok=True)
