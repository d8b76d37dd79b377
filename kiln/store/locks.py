"""Per-resource locks that hold across threads and processes.

`flock` on a lock file: two opens of the same file conflict even inside one process, so the
same lock serialises server threads and a second process (a CLI tool, a crash-test writer).
Lock files live in `<root>/.locks/` and are never deleted: unlinking a lock file while another
process waits on it would let two writers in at once.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_DIR = ".locks"


@contextmanager
def resource_lock(root: str | Path, name: str, *, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
    """Hold the lock for `name` under `root`; `shared` lets readers in together.

    Yields whether the lock is held: always True when blocking; False when `blocking=False` and
    someone else holds it. `name` must already be a validated single path segment.
    """
    lock_dir = Path(root) / LOCK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, mode if blocking else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the flock
