"""The server's start and stop around the app: the startup sweep of every store.

`startup_sweep(state)` runs in `kiln serve` before the first request: every service in
`state.services` that has a `sweep()` method (a store, or a manager over one) settles what killed
writers left, under the data directory's sweep lock (kiln/store/sweep.py). A store added later joins
by defining `sweep`; nothing here needs to change.
"""

from __future__ import annotations

from pathlib import Path

from kiln.api.state import ServerState
from kiln.store.sweep import LiveLock, Sweepable, TempFiles, sweep_all


def sweep_targets(state: ServerState) -> dict[str, Sweepable]:
    out: dict[str, Sweepable] = {name: svc for name, svc in vars(state.services).items()
                                 if callable(getattr(svc, "sweep", None))}
    out["weights_identity_cache"] = TempFiles(Path(state.settings.data.data_dir) / "cache" / "weights-identity")
    return out


def startup_sweep(state: ServerState) -> tuple[dict[str, list[str]], list[LiveLock]]:
    """Sweep every store; returns (actions per store, the locks to keep while the server lives)."""
    data_dir = Path(state.settings.data.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    roots = [data_dir]
    adapter_dir = state.settings.adapter_dir
    if not adapter_dir.resolve().is_relative_to(data_dir.resolve()):
        adapter_dir.mkdir(parents=True, exist_ok=True)
        roots.append(adapter_dir)
    return sweep_all(sweep_targets(state), roots)
