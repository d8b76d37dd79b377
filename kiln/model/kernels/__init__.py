"""The C++ kernels (quantized linear `qlinear.cpp`, batched LoRA `lora_bgmv.cpp`, fused decode ops
`decode_ops.cpp`, all layers of a decode step `decode_stack.cpp`), compiled on first use and cached.

Nothing is compiled at import: `load()` builds the extension the first time it is called (about a
minute on two cores; later processes load the cached library from the torch extensions directory,
`TORCH_EXTENSIONS_DIR` or `~/.cache/torch_extensions`). torch's builder holds a file lock while it
compiles, so concurrent first uses in several processes build once.

One build serves every x86-64 CPU: the library is compiled for the baseline ISA and its AVX2 and
AVX-512 functions carry their own target attributes (`kernels/isa.h`). Which ones run is chosen at
run time: the CPU's best ISA by default, or a lower one named by `KILN_CPU_ISA=avx2|avx512|scalar`
(or the `engine.cpu_isa` setting, through `select_isa`), so an AVX-512 machine can run and measure the
AVX2 code; asking for an ISA the CPU lacks is an error. Every kernel has a scalar path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear.cpp")
# The batched-LoRA kernel and the fused decode ops share the library (one build, one cache entry).
SOURCES = [SOURCE, *(Path(__file__).with_name(f)
                     for f in ("isa.cpp", "lora_bgmv.cpp", "decode_ops.cpp", "decode_stack.cpp", "dense_bf16.cpp",
                               "qlinear_float.cpp", "qlinear_kquant.cpp", "qlinear_kquant_q8.cpp", "kquant_pack.cpp",
                               "kquant_dequant.cpp", "kquant_input_grad.cpp", "silu_mul.cpp", "quantize_super.cpp"))]
HEADERS = [Path(__file__).with_name(f)
           for f in ("isa.h", "qlinear.h", "lora_bgmv.h", "decode_ops.h", "decode_stack.h", "dense_bf16.h",
                     "qlinear_float.h", "qlinear_kquant.h", "kquant_tiles.h", "kquant_pack.h", "silu_mul.h", "bf16_simd.h")]
# -ffp-contract=off: no silent mul+add fusion, so every ISA path rounds exactly alike
# -fopenmp: at::parallel_for is header code that runs serially unless the extension itself has OpenMP
CFLAGS = ["-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp"]
# the kernels' code paths, slowest first (levels of kernels/isa.h)
ISAS = ("scalar", "avx2", "avx512")
ISA_LEVELS = {name: level for level, name in enumerate(ISAS)}
ISA_ENV = "KILN_CPU_ISA"
# what each ISA needs, as /proc/cpuinfo names the flags (AVX2 comes with FMA and F16C)
_ISA_FLAGS = {"avx2": ("avx2", "fma", "f16c"), "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                           "avx512dq")}

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
_built: ModuleType | None = None   # the library once compiled, before load() hands it out


def load() -> ModuleType | None:
    """The compiled module, building it on the first call; None when it cannot be built."""
    global _module, _error, _built
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                module = _cached_library() or _build()
            except Exception as exc:  # no compiler, no ninja, a broken toolchain: fall back to torch
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("C++ kernels unavailable, using the torch paths (%s)", _error)
                return None
            # an ISA the CPU lacks (KILN_CPU_ISA) is the caller's error, not a reason to fall back
            _built = module
            module.set_isa(ISA_LEVELS[active_isa()])
            _module = module
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
    """The fastest code path this CPU runs ("avx512", "avx2", "scalar"), None without kernels."""
    module = load()
    if module is None:
        return None
    return ISAS[module.cpu_isa()]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not there)."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...); "" where there is none."""
    return _cpuinfo_field("vendor_id").strip()


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first processor's `name` line of /proc/cpuinfo, after the colon ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value
    return ""


def bf16_dot_outpaces_fma() -> bool:
    """Whether this CPU's vdpbf16ps (AVX512-BF16) multiplies faster than its float32 FMAs, which
    decides whether the dense bfloat16 weights are the default (loader.resolve_quantization). AMD's
    (Zen 4, Zen 5) runs a 512-bit vdpbf16ps a cycle, 32 products, twice what its FMAs give. Intel's
    (Cooper Lake to Granite Rapids) runs one every two cycles and its vcvtne2ps2bf16 as slowly, while
    two FMA units give twice vdpbf16ps's products: measured on the 2-core Intel Xeon of
    benchmarks/RESULTS.md (8 independent chains), 0.55 ns a vdpbf16ps, 0.16 ns an FMA. There the
    float-activation kernels beat the dense ones at one stream and tie them at 16-64."""
    return cpu_vendor() != "GenuineIntel"


def cpu_isas() -> list[str]:
    """The ISAs this CPU runs, slowest first (scalar always). Read from the CPU flags without building
    the kernels; where there are no flags to read, the built library's cpuid decides."""
    flags = cpu_flags()
    if not flags:
        module = _built or load()
        return list(ISAS[: module.cpu_isa() + 1]) if module is not None else ["scalar"]
    return ["scalar", *(isa for isa in ISAS[1:] if all(f in flags for f in _ISA_FLAGS[isa]))]


_selected: str | None = None   # set by select_isa; None: KILN_CPU_ISA, else the CPU's best
_forced = False                # the ISA was named (setting or KILN_CPU_ISA), not the CPU's best


def _check_isa(name: str, where: str) -> str:
    name = name.strip().lower()
    if name not in ISAS:
        raise ValueError(f"{where} must be one of auto, {', '.join(ISAS)}; got {name!r}")
    supported = cpu_isas()
    if name not in supported:
        raise ValueError(f"{where} is {name!r}, but this CPU runs only {', '.join(supported)} "
                         f"(flags: {' '.join(sorted(cpu_flags() & {f for fs in _ISA_FLAGS.values() for f in fs}))})")
    return name


def requested_isa() -> str:
    """The ISA `KILN_CPU_ISA` asks for ("auto" when unset)."""
    return os.environ.get(ISA_ENV, "").strip().lower() or "auto"


def select_isa(name: str | None = "auto") -> str:
    """Use `name` ("auto": `KILN_CPU_ISA` if set, else the CPU's best) for every kernel call that names
    no ISA; returns the ISA chosen. A ValueError names what the CPU supports when it lacks `name`."""
    global _selected, _forced
    where = "engine.cpu_isa"
    if name is None or name.strip().lower() == "auto":
        name, where = requested_isa(), ISA_ENV
    chosen = cpu_isas()[-1] if name == "auto" else _check_isa(name, where)
    _selected, _forced = chosen, name != "auto"
    if _module is not None:
        _module.set_isa(ISA_LEVELS[chosen])
    return chosen


def active_isa() -> str:
    """The ISA the kernels run (what `select_isa` chose; by default `KILN_CPU_ISA` or the CPU's best)."""
    return _selected if _selected is not None else select_isa("auto")


@contextlib.contextmanager
def using_isa(name: str) -> Iterator[str]:
    """Run the kernels on `name` inside the block (tests compare every ISA the CPU supports), then
    restore the previous choice."""
    global _selected, _forced
    previous = (_selected, _forced)
    try:
        yield select_isa(name)
    finally:
        _selected, _forced = previous
        if _module is not None:
            _module.set_isa(ISA_LEVELS[active_isa()])


def isa_forced() -> bool:
    """Whether the active ISA was asked for by name rather than picked as the CPU's best."""
    active_isa()
    return _forced


def dense_bf16_fast() -> bool:
    """Whether bfloat16 weights are the right default here: the kernels run (enabled, not failed to
    build) on AVX2 or AVX-512, whose dense kernel reads bfloat16 at the speed of the hardware, or
    their scalar path was asked for by name (the same bits as the vector paths, for testing)."""
    if _disabled or _error is not None:
        return False
    return active_isa() != "scalar" or isa_forced()


# How many leading positions of a prompt attend on the kernel on AVX2 (kernel vs SDPA, 2-core Zen 2:
# fresh prompts of 5 x 100 tokens 42 vs 69 ms a step, 1 x 500 143 vs 177 ms; 1 x 1024 544 vs 504 ms).
AVX2_KERNEL_POSITIONS = 512


def chunk_attention_kernel_positions() -> int:
    """Prompt queries at positions below this attend through the kernels' paged attention, the rest
    on torch's SDPA. On the AVX-512 path every query (1.7-4x faster at every chunk size and depth
    tried, 16 to 512 queries over 0 to 3,500 earlier positions: AMD EPYC, a fresh 512-token chunk 1.7
    vs 5.0 ms a layer, 512 queries over 3,500 positions 18.6 vs 35.2 ms). On AVX2 the kernel, which
    reads a query's K/V rows for that query alone, wins over shallow contexts (its fixed cost is
    lower) and loses to torch's blocked GEMMs over deep ones, so the first AVX2_KERNEL_POSITIONS.
    The rule is by position, not by chunk, so a query's bits never depend on how its prompt was
    chunked or cached: it attends as a decode of it would below the line, on SDPA above."""
    isa = active_isa()
    if isa == "avx512":
        return 1 << 62
    return AVX2_KERNEL_POSITIONS if isa == "avx2" else 0


def isa_report() -> dict[str, object]:
    """What /health, /v1/config and the bench report show: the ISA in use, what the CPU offers, and
    whether the kernels run at all."""
    state = "disabled" if _disabled else "ready" if _module is not None else "unavailable" if _error else "not built"
    flags = cpu_flags()
    return {"isa": active_isa() if state != "disabled" else None, "cpu_isas": cpu_isas(), "kernels": state,
            "avx512_vnni": "avx512_vnni" in flags, "avx512_bf16": "avx512_bf16" in flags}


def extension_name() -> str:
    """`kiln_kernels_<hash of the sources, flags, torch's version and their directory>`: each version
    builds into its own cache directory, so an upgrade (of Kiln or of torch, whose ABI the library is
    built against) never loads an older library. The directory counts because torch's builder writes
    the source paths into the build: two checkouts sharing one cache entry would each find it stale and
    rebuild it, in turn, every time the other had used it."""
    import torch

    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(SOURCE.parent.resolve()).encode())
    return f"kiln_kernels_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where torch's builder puts extension `name` (cpp_extension._get_build_directory, without importing
    cpp_extension: $TORCH_EXTENSIONS_DIR, else torch's cache directory's py<version>_<accelerator>)."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
                       f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / name


def _cached_library() -> ModuleType | None:
    """The library an earlier process built for these very sources (its name hashes them), imported
    straight from torch's build directory when no build holds the directory's lock: going through
    torch's builder instead imports cpp_extension and setuptools (~0.12 s of CPU at every start) and
    runs ninja to find there is nothing to do. None (then `_build`) when it is not there yet."""
    if sys.platform != "linux":
        return None
    name = extension_name()
    directory = build_directory(name)
    library = directory / f"{name}.so"
    if not library.is_file() or (directory / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STALE_LOCK_SECS = 120


def _clear_stale_lock(build_dir: Path) -> bool:
    """Remove the build lock a killed build left behind, else the next process waits on it forever:
    torch's builder holds `lock` (created exclusively, never refreshed) while ninja compiles in the
    build directory. A lock older than STALE_LOCK_SECS with no process working in that directory (on
    Linux, one whose cwd it is: ninja and the compilers it starts) belongs to nobody."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    proc = Path("/proc")
    if age < STALE_LOCK_SECS or not proc.is_dir():
        return False
    target = str(build_dir.resolve())
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == target:
                    return False
            except OSError:
                continue
    log.warning("kiln: removing a stale kernel build lock (%.0f s old, no build running): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        _clear_stale_lock(Path(cpp_extension._get_build_directory(extension_name(), verbose=False)))
    except Exception as e:  # a private torch helper: never let the check itself stop a build
        log.debug("kiln: stale-lock check skipped: %s", e)
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
