"""What the numbers were measured on: CPU, memory, library versions, threads, date and commit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


@dataclass
class MachineInfo:
    cpu_model: str
    logical_cores: int
    physical_cores: int | None
    ram_gib: float | None
    os: str
    python: str
    torch: str
    torch_threads: int
    transformers: str
    cpu_isas: str                # what Kiln's kernels can run here (the bench forces lower ones for the AVX2 pair)
    kiln: str
    load_average: str            # 1/5/15-minute load when the run started: other work skews every figure
    date: str
    git_commit: str

    def as_rows(self) -> list[tuple[str, str]]:
        labels = {
            "cpu_model": "CPU", "logical_cores": "logical cores", "physical_cores": "physical cores",
            "ram_gib": "RAM (GiB)", "os": "OS", "python": "Python", "torch": "torch",
            "torch_threads": "threads (kiln serve, llama-server)", "transformers": "transformers",
            "cpu_isas": "ISAs this CPU runs (Kiln's kernels)", "kiln": "kiln",
            "load_average": "load average at start (1/5/15 min)", "date": "date (UTC)", "git_commit": "git commit",
        }
        return [(labels[k], "—" if v is None else str(v)) for k, v in asdict(self).items()]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def physical_cores(cpuinfo: str | None = None) -> int | None:
    """Distinct (physical id, core id) pairs; None where /proc/cpuinfo does not say."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    cores: set[tuple[str, str]] = set()
    phys = core = None
    for line in [*text.splitlines(), ""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not line.strip():
            if core is not None:
                cores.add((phys or "0", core))
            phys = core = None
    return len(cores) or None


def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def git_commit(cwd: Path | None = None) -> str:
    """Short commit hash, `-dirty` when the work tree has changes; `unknown` outside a git checkout."""
    where = cwd or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def cpu_isas_text() -> str:
    """e.g. "scalar, avx2, avx512 (+avx512_vnni, +avx512_bf16)"."""
    from kiln.model import kernels

    report = kernels.isa_report()
    extras = [f"+{f}" for f in ("avx512_vnni", "avx512_bf16") if report[f]]
    return ", ".join(kernels.cpu_isas()) + (f" ({', '.join(extras)})" if extras else "")


def collect_machine_info(threads: int) -> MachineInfo:
    import torch

    import kiln

    return MachineInfo(
        cpu_model=cpu_model(), logical_cores=os.cpu_count() or 1, physical_cores=physical_cores(),
        ram_gib=ram_gib(), os=platform.platform(), python=sys.version.split()[0], torch=torch.__version__,
        torch_threads=threads, transformers=package_version("transformers"),
        cpu_isas=cpu_isas_text(), kiln=kiln.__version__, load_average=load_average(),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), git_commit=git_commit(),
    )
