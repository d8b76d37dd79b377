"""Read an uploaded corpus into data.jsonl, checking every row and collecting its identity.

JSONL is stored verbatim; a JSON array (first non-blank byte `[`, any format but raw) is rewritten
as compact JSONL. The same scanner re-reads a stored data.jsonl when a manifest must be rebuilt,
so an upload and a rebuild derive identical identities and stats from identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kiln.data.formats import RAW, check_row, invalid, parse_row
from kiln.data.identity import content_sha256, normalized_sha256, row_link_id
from kiln.data.split import RowIdentity
from kiln.data.stats import StatsAccumulator
from kiln.store.strict_json import loads_strict

CHUNK = 1 << 20


@dataclass
class ScanResult:
    fmt: str
    rows: list[RowIdentity] = field(default_factory=list)
    stats: StatsAccumulator | None = None
    size_bytes: int = 0
    data_sha256: str = ""


class _Scanner:
    def __init__(self, fmt: str) -> None:
        self.result = ScanResult(fmt=fmt, stats=StatsAccumulator(fmt))
        self._hash = hashlib.sha256()
        self._line_no = 0

    def feed(self, line: bytes, *, where: str | None = None) -> None:
        """One physical line (with its newline, if any) in file order."""
        self._hash.update(line)
        self.result.size_bytes += len(line)
        self._line_no += 1
        if not line.strip():
            return
        where = where or f"line {self._line_no}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"{where} is not valid UTF-8", param="file") from None
        if self._line_no == 1:
            text = text.removeprefix("\ufeff")
        value = parse_row(text, self.result.fmt, where)
        self.add_value(value, where)

    def feed_parsed(self, line: bytes, value: Any, where: str) -> None:
        """A line this module wrote itself from an already-checked value."""
        self._hash.update(line)
        self.result.size_bytes += len(line)
        self._line_no += 1
        self.add_value(value, where)

    def add_value(self, value: Any, where: str) -> None:
        try:
            content, normalized = content_sha256(value), normalized_sha256(value)
        except UnicodeEncodeError:
            raise invalid(f"{where} contains an unpaired surrogate escape", param="file") from None
        res = self.result
        res.rows.append(RowIdentity(len(res.rows) + 1, content, normalized,
                                    row_link_id(value, "group_id"), row_link_id(value, "session_id")))
        res.stats.add(value)

    def finish(self) -> ScanResult:
        if not self.result.rows:
            raise invalid("the file has no rows; at least one non-empty row is required", param="file")
        self.result.data_sha256 = "sha256:" + self._hash.hexdigest()
        return self.result


def _lines(src: BinaryIO, head: bytes) -> Iterator[bytes]:
    """Physical lines of `head` + the rest of `src`, each with its trailing newline when present."""
    pending: list[bytes] = []
    chunk = head
    while True:
        parts = chunk.split(b"\n")
        for part in parts[:-1]:
            pending.append(part)
            yield b"".join(pending) + b"\n"
            pending.clear()
        if parts[-1]:
            pending.append(parts[-1])  # a line longer than a chunk is joined once, at its end
        chunk = src.read(CHUNK)
        if not chunk:
            break
    if pending:
        yield b"".join(pending)


def _read_head(src: BinaryIO) -> bytes:
    """Bytes up to and including the first non-whitespace byte (or everything if all blank)."""
    head = b""
    while True:
        chunk = src.read(CHUNK)
        if not chunk:
            return head
        head += chunk
        if head.strip():
            return head


def _array_lines(data: bytes) -> Iterable[tuple[bytes, Any, str]]:
    try:
        values = loads_strict(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise invalid("the file is not valid UTF-8", param="file") from None
    except ValueError as e:
        raise invalid(f"the file starts with '[' but is not a valid JSON array: {e}", param="file") from None
    if not isinstance(values, list):
        raise invalid("the file starts with '[' but is not a JSON array", param="file")
    for i, value in enumerate(values, start=1):
        line = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
        yield line, value, f"array item {i}"


def ingest(src: BinaryIO, fmt: str, dest: Path) -> ScanResult:
    """Validate `src` row by row while writing data.jsonl to `dest` (fsynced)."""
    scanner = _Scanner(fmt)
    head = _read_head(src)
    with open(dest, "wb") as out:
        if fmt != RAW and head.lstrip()[:1] == b"[":
            for line, value, where in _array_lines(head + src.read()):
                check_row(value, fmt, where)
                out.write(line)
                scanner.feed_parsed(line, value, where)
        else:
            for line in _lines(src, head):
                out.write(line)
                scanner.feed(line)
        out.flush()
        os.fsync(out.fileno())
    return scanner.finish()


def scan(path: Path, fmt: str) -> ScanResult:
    """Identities and stats of a stored data.jsonl."""
    scanner = _Scanner(fmt)
    with open(path, "rb") as f:
        for line in _lines(f, b""):
            scanner.feed(line)
    return scanner.finish()


def iter_values(source: Path | BinaryIO, fmt: str) -> Iterator[tuple[bytes, Any]]:
    """(stripped line, parsed row) for every non-blank line of a stored JSONL file (path or open file)."""
    if isinstance(source, Path):
        with open(source, "rb") as f:
            yield from iter_values(f, fmt)
        return
    first = True
    for line in _lines(source, b""):
        stripped = line.strip()
        if first:
            stripped = stripped.removeprefix(b"\xef\xbb\xbf")
            first = False
        if not stripped:
            continue
        text = stripped.decode("utf-8")
        try:
            yield stripped, loads_strict(text)
        except ValueError:
            if fmt != RAW:
                raise
            yield stripped, text
