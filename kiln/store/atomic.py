"""Crash-safe file writes: temp file, fsync, rename, fsync of the directory.

A reader after a kill at any instant sees the old bytes or the new bytes, never a torn file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def store_root(root: str | Path) -> Path:
    """A store's root folder, created when it can be; a read-only location is left for the store to report."""
    path = Path(root)
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True)
    return path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)   # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


# read once, at import: os.umask is process-wide, so reading it later could race another thread's write
_NEW_FILE_MODE = 0o666 & ~_umask()


def _mode_for(path: Path) -> int:
    """The replaced file's permissions, or what open() would give a new one (mkstemp's are 0600)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return _NEW_FILE_MODE


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with contextlib.suppress(OSError):   # a filesystem without modes keeps the file as mkstemp made it
            os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temp file's name beside `path`, for a writer that takes a file name (a library, another
    program): when the block exits it is fsynced and renamed onto `path`; if the block raises it is
    removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with contextlib.suppress(OSError):
            os.chmod(tmp, _mode_for(path))
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the bytes that content hashes are taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 2) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    atomic_write_text(path, text + "\n")


def append_jsonl(path: str | Path, rows: list[Any]) -> None:
    """Append rows and fsync before returning, so an acknowledged row survives a crash.

    A crash mid-append can leave a partial last line; `read_jsonl` drops such a tail.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in rows)
    existed = path.exists()
    with open(path, "ab") as f:
        # A previous crash may have left a torn line without newline: start on a fresh line.
        if existed and f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":
                    data = b"\n" + data
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if not existed:
        fsync_path(path.parent)


def read_jsonl(path: str | Path, *, skip_invalid: bool = False) -> list[Any]:
    """Read JSON lines, skipping blank lines and a torn (unparseable) final line.

    `skip_invalid` also skips unparseable lines in the middle: a torn line stays in the middle of
    an append-only file once a later append has started on a fresh line after it.
    """
    out: list[Any] = []
    path = Path(path)
    if not path.exists():
        return out
    lines = path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if skip_invalid:
                continue
            if i == len(lines) - 1 or all(not rest.strip() for rest in lines[i + 1 :]):
                break  # torn tail from a crash mid-append
            raise
    return out

