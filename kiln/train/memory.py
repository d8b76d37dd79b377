"""Resident memory of this process, for the job record: now, and the peak since a job started.

On Linux the kernel's high-water mark (VmHWM) is reset at job start (`/proc/self/clear_refs`), so the
peak includes transient backward-pass allocations between samples. Elsewhere, or where the reset is
not permitted, the peak is the largest value sampled at step boundaries.
"""

from __future__ import annotations

import resource


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mb() -> float:
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Start a new high-water mark; False when the platform does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb(sampled: float) -> float:
    """The kernel's high-water mark when it was reset, else the best sample so far."""
    kb = _status_kb("VmHWM")
    return max(sampled, kb / 1024) if kb is not None else sampled


class PeakTracker:
    def __init__(self) -> None:
        self.start_mb = rss_mb()
        self.exact = reset_peak()
        self.sampled = self.start_mb

    def sample(self) -> float:
        self.sampled = max(self.sampled, rss_mb())
        return peak_mb(self.sampled) if self.exact else self.sampled
