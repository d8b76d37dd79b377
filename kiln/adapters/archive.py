"""tar.gz in and out of the adapter store, treating every uploaded archive as hostile.

Extraction bounds the compressed bytes read, the decompressed stream, the extracted file bytes and the
entry count; it writes only regular files and directories, with names that stay under the target.
Streaming out writes tar headers by hand so a large adapter never sits whole in memory.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kiln.errors import KilnError

IMPORT_INVALID = "adapter_import_invalid"
_CHUNK = 1 << 20


@dataclass
class ArchiveLimits:
    """Upload bounds (semantics.md §1.9): request body, extracted bytes, archive entries."""

    max_body_bytes: int = 2 << 30
    max_extracted_bytes: int = 4 << 30
    max_entries: int = 100_000


def import_error(message: str, *, param: str = "archive", hint: str | None = None) -> KilnError:
    return KilnError(400, IMPORT_INVALID, f"Invalid adapter archive: {message}", param=param,
                     hint=hint or "Upload a tar.gz of the adapter folder (adapter_config.json + "
                                  "adapter_model.safetensors), regular files only.")


class _BoundedReader(io.RawIOBase):
    """Reads at most `limit` bytes from `raw`; one byte more is an import error, not a truncation."""

    def __init__(self, raw: BinaryIO, limit: int, what: str) -> None:
        self.raw, self.left, self.what, self.limit = raw, limit, what, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[override]
        data = self.raw.read(min(len(buf), self.left + 1))
        if len(data) > self.left:
            raise import_error(f"{self.what} exceeds the limit of {self.limit} bytes")
        self.left -= len(data)
        buf[: len(data)] = data
        return len(data)


_DRIVE = re.compile(r"^[A-Za-z]:")


def _safe_relpath(name: str) -> tuple[str, ...] | None:
    """Path components of an entry name, () for the archive root, None when it could escape."""
    if "\x00" in name or name.startswith(("/", "\\")) or _DRIVE.match(name):
        return None
    parts = [p for p in re.split(r"[/\\]", name) if p not in ("", ".")]
    if any(p == ".." for p in parts):
        return None
    return tuple(parts)


def extract_tar_gz(fileobj: BinaryIO, target: Path, limits: ArchiveLimits) -> int:
    """Extract into the existing empty dir `target`; return the extracted file bytes.

    Raises a 400 adapter_import_invalid on the first hostile or malformed entry; the caller removes
    `target` (it is a staging dir) so nothing is left behind.
    """
    compressed = _BoundedReader(fileobj, limits.max_body_bytes, "archive")
    # Headers cost blocks too: allow them on top of the file bytes so only real bombs trip this.
    stream_cap = limits.max_extracted_bytes + (limits.max_entries + 4) * 3 * 512 + (1 << 20)
    try:
        plain = _BoundedReader(gzip.GzipFile(fileobj=io.BufferedReader(compressed)), stream_cap,
                               "decompressed archive")
        with tarfile.open(fileobj=io.BufferedReader(plain), mode="r|") as tar:
            return _extract_members(tar, target, limits)
    except KilnError:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise import_error(f"not a readable tar.gz ({type(e).__name__}: {e})") from None


def _extract_members(tar: tarfile.TarFile, target: Path, limits: ArchiveLimits) -> int:
    total = entries = 0
    seen: set[tuple[str, ...]] = set()
    for member in tar:
        entries += 1
        if entries > limits.max_entries:
            raise import_error(f"more than {limits.max_entries} entries")
        parts = _safe_relpath(member.name)
        if parts is None:
            raise import_error(f"entry {member.name!r} is an absolute path or leaves the archive root")
        if member.issparse() or not (member.isreg() or member.isdir()):
            kind = ("symlink" if member.issym() else "hard link" if member.islnk()
                    else "device" if member.isdev() else "special file")
            raise import_error(f"entry {member.name!r} is a {kind}; only regular files are accepted")
        if not parts:
            continue
        if parts in seen:
            raise import_error(f"entry {member.name!r} appears twice")
        seen.add(parts)
        dest = target.joinpath(*parts)
        if member.isdir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        total += member.size
        if total > limits.max_extracted_bytes:
            raise import_error(f"extracted size exceeds the limit of {limits.max_extracted_bytes} bytes")
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(member)
        assert src is not None
        with open(dest, "xb") as out:
            while block := src.read(_CHUNK):
                out.write(block)
    if entries == 0:
        raise import_error("the archive is empty")
    return total


def _tar_header(arcname: str, size: int, mtime: float, is_dir: bool) -> bytes:
    info = tarfile.TarInfo(arcname)
    info.size = 0 if is_dir else size
    info.mtime = int(mtime)
    info.mode = 0o755 if is_dir else 0o644
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT)


def iter_tar_gz(root: Path, arc_root: str) -> Iterator[bytes]:
    """Stream root/ as a gzip'd tar with every path under `arc_root/`; regular files only."""
    gz = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: gzip container
    for chunk in _tar_blocks(root, arc_root):
        if out := gz.compress(chunk):
            yield out
    yield gz.flush()


def _tar_blocks(root: Path, arc_root: str) -> Iterator[bytes]:
    yield _tar_header(arc_root, 0, root.stat().st_mtime, True)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for d in list(dirnames):
            st = os.lstat(os.path.join(dirpath, d))
            if not stat.S_ISDIR(st.st_mode):
                continue
            yield _tar_header(f"{arc_root}/{(rel_dir / d).as_posix()}", 0, st.st_mtime, True)
        for fname in sorted(filenames):
            path = os.path.join(dirpath, fname)
            try:
                # O_NONBLOCK: opening a FIFO must not hang the download; it is skipped below.
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # a symlink (O_NOFOLLOW) or a file that vanished: never followed
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue  # fifo, device, socket
                yield _tar_header(f"{arc_root}/{(rel_dir / fname).as_posix()}", st.st_size, st.st_mtime, False)
                left = st.st_size
                while left > 0:
                    block = f.read(min(_CHUNK, left))
                    if not block:
                        raise OSError(f"{path} shrank while it was being archived")
                    left -= len(block)
                    yield block
                pad = -st.st_size % tarfile.BLOCKSIZE
                if pad:
                    yield b"\0" * pad
    yield b"\0" * tarfile.BLOCKSIZE * 2
