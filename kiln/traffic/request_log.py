"""The durable request log: JSON lines written by one background thread, rotated by size, capped in total.

Files in the log directory, oldest first by name:
  requests-<UTC stamp>.jsonl[.gz]   rotated (gzip-compressed when `compress`)
  requests-current.jsonl            the one being appended to

`RequestLog.write(row)` never blocks and never raises: it puts the row on a bounded queue, and a full
queue (the disk cannot keep up) drops the row and counts it, since stalling inference on a log would
be the wrong trade. The writer thread drains the queue in batches: it appends each row as one line
handed to the OS at once (a killed process loses at most the row mid-write, and whatever still waited
in the queue, normally nothing), then fsyncs once per batch (what survives a power cut), so a torn
last line is the only damage a crash can leave. At start the writer cuts a
torn tail off the current file, so torn bytes never sit between whole lines.

Rotation: the current file is renamed to a stamped name (directory fsynced), a fresh one is opened,
then the rotated file is compressed to `.jsonl.gz.tmp`, fsynced and renamed into place before the
plain file goes. A kill at any point leaves the plain file, or both (readers take the `.gz`; the next
start removes the plain copy), never neither. Retention deletes the oldest rotated files while the
directory holds more than `max_total_bytes`; the current file is never deleted.

`flush()` waits until everything queued so far is on disk; `close()` flushes and stops the thread.
Both are safe to call from a shutdown path, more than once, from any thread.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from kiln.store.atomic import fsync_path

log = logging.getLogger("kiln.request_log")

ACTIVE = "requests-current.jsonl"
PREFIX = "requests-"
DEFAULT_MAX_FILE_BYTES = 64 << 20
DEFAULT_MAX_TOTAL_BYTES = 2 << 30
DEFAULT_MAX_ROW_BYTES = 4 << 20
DEFAULT_QUEUE_ROWS = 1024
_BATCH = 256


@dataclass
class LogStats:
    written: int = 0
    dropped: int = 0       # queue full, or written after close
    truncated: int = 0     # rows over max_row_bytes, stored without their bodies
    errors: int = 0        # rows the disk refused (logged)
    rotations: int = 0


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class RequestLog:
    def __init__(self, root: str | Path, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES, compress: bool = True,
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, queue_rows: int = DEFAULT_QUEUE_ROWS) -> None:
        self.root = Path(root)
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.compress = compress
        self.max_row_bytes = max_row_bytes
        self.stats = LogStats()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_rows))
        self._closed = False
        self._close_lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        recover(self.root, compress=compress)
        self._file: IO[bytes] = open(self.root / ACTIVE, "ab")  # noqa: SIM115 - the writer thread owns it
        self._size = self._file.tell()
        self._thread = threading.Thread(target=self._run, name="kiln-request-log", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------------------
    def write(self, row: dict[str, Any]) -> bool:
        """Queue one row; False when it was dropped (queue full or log closed)."""
        if self._closed:
            self.stats.dropped += 1
            return False
        try:
            self._queue.put_nowait(row)
            return True
        except queue.Full:
            self.stats.dropped += 1
            if self.stats.dropped == 1 or self.stats.dropped % 1000 == 0:
                log.warning("request log cannot keep up: %d rows dropped so far", self.stats.dropped)
            return False

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until every row queued before this call is written and fsynced."""
        if not self._thread.is_alive():
            return self._queue.empty()
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop; later writes are dropped. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=timeout)
            self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def find(self, row_id: str) -> dict[str, Any] | None:
        """The newest row with this `id` (a scan, newest file first; the slow path behind the ring)."""
        needle = json.dumps(row_id).encode()
        for path in reversed(log_files(self.root)):
            found = None
            for line in _lines(path):
                if needle in line:
                    row = _parse(line)
                    if row is not None and row.get("id") == row_id:
                        found = row
            if found is not None:
                return found
        return None

    # ---- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        while not stop:
            items = [self._queue.get()]
            while len(items) < _BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            markers = []
            for item in items:
                if item is _STOP:
                    stop = True
                elif isinstance(item, _Flush):
                    markers.append(item)
                else:
                    self._append(item)
            self._sync()
            for marker in markers:
                marker.done.set()
        with contextlib.suppress(OSError):
            self._file.close()

    def _encode(self, row: dict[str, Any]) -> bytes:
        data = json.dumps(row, ensure_ascii=False).encode("utf-8")
        if len(data) <= self.max_row_bytes:
            return data
        self.stats.truncated += 1
        slim = {k: v for k, v in row.items() if k not in ("messages", "prompts", "tools", "choices")}
        slim["truncated"] = True
        slim["original_bytes"] = len(data)
        return json.dumps(slim, ensure_ascii=False).encode("utf-8")

    def _append(self, row: dict[str, Any]) -> None:
        try:
            line = self._encode(row) + b"\n"
            self._file.write(line)
            self._file.flush()  # in the OS per row: a killed process loses only a row mid-write
            self._size += len(line)
            self.stats.written += 1
        except (OSError, TypeError, ValueError) as e:
            self.stats.errors += 1
            log.warning("request log: row %s not written: %s", row.get("id"), e)
            return
        if self._size >= self.max_file_bytes:
            self._sync()
            self._rotate()

    def _sync(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            self.stats.errors += 1
            log.warning("request log: flush failed: %s", e)

    def _rotate(self) -> None:
        try:
            self._file.close()
            rotated = _rotated_name(self.root)
            os.replace(self.root / ACTIVE, rotated)
            fsync_path(self.root)
            self._file = open(self.root / ACTIVE, "ab")  # noqa: SIM115
            self._size = 0
            self.stats.rotations += 1
            if self.compress:
                compress_file(rotated)
            enforce_retention(self.root, self.max_total_bytes)
        except OSError as e:
            self.stats.errors += 1
            log.warning("request log: rotation failed: %s", e)
            if self._file.closed:
                self._file = open(self.root / ACTIVE, "ab")  # noqa: SIM115
                self._size = self._file.tell()


# ---- files --------------------------------------------------------------------------------------------

def _rotated_name(root: Path) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    path = root / f"{PREFIX}{stamp}.jsonl"
    n = 1
    while path.exists() or path.with_suffix(".jsonl.gz").exists():
        path = root / f"{PREFIX}{stamp}-{n}.jsonl"
        n += 1
    return path


def compress_file(path: Path) -> Path:
    """`x.jsonl` -> `x.jsonl.gz`, crash-safe: the plain file goes only once the gzip is durable."""
    gz = path.with_name(path.name + ".gz")
    tmp = path.with_name(path.name + ".gz.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            shutil.copyfileobj(src, out, 1 << 20)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, gz)
    fsync_path(path.parent)
    os.unlink(path)
    fsync_path(path.parent)
    return gz


def _rotated(root: Path) -> list[Path]:
    names = {p.name for p in root.iterdir() if p.is_file()} if root.is_dir() else set()
    out = []
    for name in sorted(names):
        if not name.startswith(PREFIX) or name == ACTIVE:
            continue
        if name.endswith(".jsonl.gz") or (name.endswith(".jsonl") and name + ".gz" not in names):
            out.append(root / name)
    return out


def log_files(root: str | Path) -> list[Path]:
    """Every readable log file, oldest first (rotated by name, then the current one)."""
    root = Path(root)
    files = _rotated(root)
    if (root / ACTIVE).is_file():
        files.append(root / ACTIVE)
    return files


def recover(root: Path, *, compress: bool) -> None:
    """Undo what a crash mid-write or mid-rotation left behind (the writer calls this at start)."""
    for p in root.glob(f"{PREFIX}*.gz.tmp"):
        p.unlink()
    for gz in root.glob(f"{PREFIX}*.jsonl.gz"):
        plain = gz.with_name(gz.name[:-3])
        if plain.exists():
            plain.unlink()  # the gzip was durable before the plain copy was to go
    if compress:
        for p in _rotated(root):
            if p.name.endswith(".jsonl"):
                compress_file(p)
    active = root / ACTIVE
    if active.is_file() and active.stat().st_size:
        _cut_torn_tail(active)


def _cut_torn_tail(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        # Find the last newline; everything after it is one torn, unacknowledged line.
        pos, block = size, 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("request log: cut a torn last line (%d bytes) off %s", size - keep, path.name)


def enforce_retention(root: Path, max_total_bytes: int) -> list[Path]:
    rotated = _rotated(root)
    active = root / ACTIVE
    total = sum(p.stat().st_size for p in rotated) + (active.stat().st_size if active.exists() else 0)
    removed = []
    for p in rotated:
        if total <= max_total_bytes:
            break
        size = p.stat().st_size
        p.unlink()
        total -= size
        removed.append(p)
    if removed:
        fsync_path(root)
    return removed


def _lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            yield from f
    except (OSError, EOFError) as e:  # a truncated gzip (should not happen) reads up to the damage
        log.warning("request log: stopped reading %s: %s", path.name, e)


def _parse(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # a torn tail (the current file, mid-write or after a crash)
    return row if isinstance(row, dict) else None


def read_rows(root: str | Path) -> Iterator[dict[str, Any]]:
    """Every whole row, oldest first; a torn line is skipped, never an error."""
    for path in log_files(root):
        for line in _lines(path):
            row = _parse(line)
            if row is not None:
                yield row
