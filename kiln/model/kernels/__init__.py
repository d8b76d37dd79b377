"""The C++ kernels (quantized linear `qlinear.cpp`, batched LoRA `lora_bgmv.cpp`, fused decode ops
`decode_ops.cpp`, all layers of a decode step `decode_stack.cpp`), compiled on first use and cached.

Nothing is compiled at import: `load()` builds the extension the first time it is called (about a
minute on two cores; later processes load the cached library from the torch extensions directory,
`TORCH_EXTENSIONS_DIR` or `~/.cache/torch_extensions`). torch's builder holds a file lock while it
compiles, so concurrent first uses in several processes build once. The library is compiled for the
baseline ISA; its AVX2 and AVX512-VNNI functions carry their own target attributes and are chosen
at run time from cpuid, so a cached build never executes instructions the CPU lacks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear.cpp")
# The batched-LoRA kernel and the fused decode ops share the library (one build, one cache entry).
SOURCES = [SOURCE, *(Path(__file__).with_name(f) for f in ("lora_bgmv.cpp", "decode_ops.cpp", "decode_stack.cpp", "dense_bf16.cpp"))]
HEADERS = [Path(__file__).with_name(f) for f in ("qlinear.h", "lora_bgmv.h", "decode_ops.h", "decode_stack.h", "dense_bf16.h")]
# -ffp-contract=off: no silent mul+add fusion, so every ISA path rounds exactly alike
# -fopenmp: at::parallel_for is header code that runs serially unless the extension itself has OpenMP
CFLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
ISA_LEVELS = {"scalar": 0, "avx2": 1, "avx512_vnni": 2}

DISABLE_ENV = "KILN_DISABLE_KERNELS"


def _disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


# read once: looking the variable up costs as much as a small GEMV call
_disabled = _disabled_by_env()


def refresh_from_env() -> None:
    """Re-read `KILN_DISABLE_KERNELS` (it is read once, at import)."""
    global _disabled
    _disabled = _disabled_by_env()


def enabled() -> bool:
    """False when `KILN_DISABLE_KERNELS` asks for the torch paths everywhere."""
    return not _disabled


def for_tensor(x) -> ModuleType | None:
    """The built module for a CPU tensor outside autograd; None on CUDA, when disabled, or while the
    library is still building (see `ready`)."""
    if _disabled or not x.is_cpu or x.requires_grad:
        return None
    return ready()


_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_background: threading.Thread | None = None


def load() -> ModuleType | None:
    """The compiled module, building it on the first call; None when it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no ninja, a broken toolchain: fall back to torch
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("C++ kernels unavailable, using the torch paths (%s)", _error)
    return _module


def ready() -> ModuleType | None:
    """The module if it is built already; otherwise start building it in the background and return
    None, so a hot path that has a torch fallback never waits a minute for the compiler."""
    global _background
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _background is None:
            _background = threading.Thread(target=load, name="kiln-kernels-build", daemon=True)
            _background.start()
    return None


def load_error() -> str | None:
    """Why `load()` returned None (after it did)."""
    return _error


def best_isa() -> str | None:
    """The fastest code path this CPU runs ("avx512_vnni", "avx2", "scalar"), None without kernels."""
    module = load()
    if module is None:
        return None
    level = module.best_isa()
    return next(name for name, value in ISA_LEVELS.items() if value == level)


def extension_name() -> str:
    """`kiln_kernels_<hash of the sources, flags and their directory>`: each version builds into its
    own cache directory, so an upgrade never loads an older library. The directory counts because
    torch's builder writes the source paths into the build: two checkouts sharing one cache entry
    would each find it stale and rebuild it, in turn, every time the other had used it."""
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(str(SOURCE.parent.resolve()).encode())
    return f"kiln_kernels_{digest.hexdigest()[:12]}"


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    log.info("kiln: preparing the C++ kernels (compiled on first use, then cached)")
    start = time.perf_counter()
    module = cpp_extension.load(
        name=extension_name(),
        sources=[str(s) for s in SOURCES],
        extra_include_paths=[str(SOURCE.parent)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-lpthread", "-fopenmp"],
        verbose=False,
    )
    log.info("kiln: C++ kernels ready in %.1f s", time.perf_counter() - start)
    return module


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel's binary is not there unless the venv is active."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
