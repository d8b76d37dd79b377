"""The startup sweep: each store removes what killed writers left of its own scratch files.

A store takes part by having `sweep() -> list[str]`: it deletes (or, for a half-done replace, restores)
the temp files and half-made directories of its own layout -- never a committed file -- and returns one
line per action. `kiln serve` sweeps every service in `ServerState.services` that has one, before it
answers a request, and logs each action; a new store joins by defining `sweep`.

Another live process may be writing to the same directories (a second server on the same data dir):
its scratch files are not orphans. So the sweep runs only while holding `<root>/.locks/sweep.lock`
exclusively, and every server keeps a shared lock on it for its lifetime: a second server finds the
lock shared, skips the sweep and says so.

Helpers here know the two scratch shapes every store uses: `atomic_write_*`'s temp files
(`.<name>.<random>.tmp` beside the target) and `dirswap`'s staging/old/trash directories.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from kiln.store import dirswap
from kiln.store.locks import LOCK_DIR, resource_lock

log = logging.getLogger("kiln.store")

SWEEP_LOCK = "sweep.lock"


class Sweepable(Protocol):
    def sweep(self) -> list[str]: ...


def is_atomic_temp(entry: str) -> bool:
    """A temp file of `atomic_write_bytes` (`.<target>.<random>.tmp`); committed names never start with '.'."""
    return entry.startswith(".") and entry.endswith(".tmp") and entry != ".tmp"


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep_temp_files(folder: Path) -> list[str]:
    """Delete atomic-write temp files directly inside `folder`."""
    done: list[str] = []
    if not folder.is_dir():
        return done
    for entry in sorted(os.listdir(folder)):
        path = folder / entry
        if is_atomic_temp(entry) and path.is_file():
            path.unlink(missing_ok=True)
            done.append(f"removed {path}")
    return done


def sweep_named_folders(root: Path) -> list[str]:
    """The sweep of a store of named folders replaced through `dirswap` (datasets, judgments): settle the
    scratch copies of names no live writer holds, then stray temp files at the root and in each folder."""
    done: list[str] = []
    if not root.is_dir():
        return done
    for name in sorted(dirswap.scratch_names(root)):
        with resource_lock(root, name, blocking=False) as held:
            if held:
                done += dirswap.recover(root, name)
    done += sweep_temp_files(root)
    for entry in sorted(os.listdir(root)):
        if not entry.startswith(".") and (root / entry).is_dir():
            with resource_lock(root, entry, blocking=False) as held:
                if held:
                    done += sweep_temp_files(root / entry)
    return done


class LiveLock:
    """This process's claim on a store root: shared for its lifetime, exclusive while it sweeps."""

    def __init__(self, root: Path) -> None:
        self.root = root
        lock_dir = root / LOCK_DIR
        lock_dir.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(lock_dir / SWEEP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)

    def try_exclusive(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def share(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def close(self) -> None:
        os.close(self.fd)


def sweep_all(stores: dict[str, Sweepable], roots: Iterable[Path]) -> tuple[dict[str, list[str]], list[LiveLock]]:
    """Sweep every store when no other live process uses `roots`; returns (actions per store, the locks
    the caller keeps for its lifetime). Skipped entirely, with a warning, when another process holds them."""
    locks = [LiveLock(Path(r)) for r in dict.fromkeys(Path(r) for r in roots)]
    exclusive = [lock.try_exclusive() for lock in locks]
    results: dict[str, list[str]] = {}
    if all(exclusive):
        for name, store in stores.items():
            try:
                results[name] = store.sweep()
            except OSError as e:
                log.warning("startup sweep of the %s store failed: %s", name, e)
                continue
            for line in results[name]:
                log.info("startup sweep (%s): %s", name, line)
        total = sum(len(v) for v in results.values())
        log.info("startup sweep: %d orphaned temp file(s) or directory(ies) settled across %d store(s)", total,
                 len(results))
    else:
        busy = [str(lock.root) for lock, ok in zip(locks, exclusive, strict=True) if not ok]
        log.warning("startup sweep skipped: another live process uses %s", ", ".join(busy))
    for lock in locks:
        lock.share()
    return results, locks


class TempFiles:
    """A plain folder of atomically written files (a cache): its sweep removes their temp files."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def sweep(self) -> list[str]:
        return sweep_temp_files(self.folder)
