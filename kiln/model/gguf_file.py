"""A lean GGUF (v2/v3, little-endian) parser: metadata as Python values, tensors as zero-copy views.

`gguf.GGUFReader` wraps every array element in a numpy memmap, which costs ~3 s for a vocabulary of
50k tokens + merges; parsing with `struct` over an mmap takes a few hundred ms. Tensor payloads stay
in the format `gguf.quants.dequantize` expects (rows x bytes for quantized types).

The file is mapped read-only and shared, so every page a loader reads counts in its resident set
until the mapping goes: a loader that copies each tensor out (packs its blocks, dequantizes it) calls
`GGUFFile.release` once done with it, which drops that range's pages from the process (the page cache
keeps them; reading the range again faults them back in, from the same bytes), so loading holds about
one tensor of the file at a time instead of all of it.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

_SCALARS = {  # GGUF value type -> (struct code, numpy dtype)
    0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
    4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
    10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64),
}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this parser reads."""


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]   # torch order (outermost first), i.e. GGUF dims reversed
    data: np.ndarray         # float array of `shape` for F32/F16; uint8 [..., row bytes] otherwise
    offset: int = 0          # where `data` starts in the file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    mapping: mmap.mmap | None = None   # the file's read-only mapping, which every tensor's `data` views

    def release(self, tensor: GGUFTensor) -> None:
        """Drop `tensor`'s pages from this process's resident set (MADV_DONTNEED on its range, widened
        to whole pages). Safe whatever still views them: the mapping is a read-only view of the file,
        so a later read faults the same bytes back in."""
        release_range(self.mapping, tensor.offset, tensor.data.nbytes)


def release_range(buf: mmap.mmap | None, start: int, length: int) -> None:
    """MADV_DONTNEED over the whole pages covering `[start, start + length)` of `buf` (a no-op where
    the platform has no madvise)."""
    if buf is None or length <= 0 or not hasattr(buf, "madvise"):
        return
    lo = start - start % mmap.PAGESIZE
    hi = min(len(buf), start + length)
    buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges: ~200k of them), in one tight loop: through
        `string` each costs three calls and a struct format lookup, a second of a 1B model's load."""
        buf, pos, out = self.buf, self.pos, []
        length = struct.Struct("<Q").unpack_from
        append = out.append
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def skip(self, vtype: int) -> None:
        """Move past a value without building it (a vocabulary's strings: only their lengths are read)."""
        if vtype == _STRING:
            self.pos += 8 + self.scalar("Q")
        elif vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype][0])
            elif etype == _STRING:
                buf, pos, length = self.buf, self.pos, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip(etype)
        elif vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype][0])
        else:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")


def _read_header(buf: mmap.mmap, path: str | Path, only: frozenset[str] | None = None,
                 ) -> tuple[_Cursor, int, dict[str, Any]]:
    """(cursor after the key/values, tensor count, metadata); `only`: the keys to read, the others'
    values are skipped."""
    cur = _Cursor(buf)
    if buf[:4] != MAGIC:
        raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.scalar("I")
        if only is None or key in only:
            metadata[key] = cur.value(vtype)
        else:
            cur.skip(vtype)
    return cur, n_tensors, metadata


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Only the key/values (tokenizer.* included), as plain Python values (str, int, float, bool, lists)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _read_header(buf, path)[2]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]   # torch order, as GGUFTensor's


def read_gguf_tensor_infos(path: str | Path) -> tuple[TensorInfo, ...]:
    """The tensors' names, types and shapes, parsed once per version of the file (its size and mtime):
    the loader asks for them twice before it reads the file (auto's choice, the dense copy's size),
    and each parse walks the whole vocabulary."""
    st = os.stat(path)
    return _tensor_infos(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tensor_infos(path: str, size: int, mtime_ns: int) -> tuple[TensorInfo, ...]:
    # the key/values are skipped, not built (only the alignment is read): ~half the parse's time
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return tuple(TensorInfo(t.name, t.qtype, t.shape) for t in _parse(buf, path, frozenset({ALIGNMENT_KEY}))[1])


def read_gguf(path: str | Path) -> GGUFFile:
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    metadata, tensors = _parse(buf, path)
    return GGUFFile(metadata, tensors, buf)


def _parse(buf: mmap.mmap, path: str | Path, only: frozenset[str] | None = None,
           ) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors viewing `buf`); `only`: the metadata keys to read (`_read_header`)."""
    cur, n_tensors, metadata = _read_header(buf, path, only)

    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        qtype, offset = cur.scalar("I"), cur.scalar("Q")
        infos.append((name, dims, qtype, offset))
    alignment = int(metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    # the key/values (a vocabulary, its merges: megabytes) are Python values now
    release_range(buf, 0, cur.pos)

    tensors = []
    for name, dims, qtype_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {qtype_id}") from None
        shape = tuple(int(d) for d in reversed(dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * type_size
        n_rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        if qtype in _PLAIN_DTYPES:
            count = n_rows * dims[0]
            data = np.frombuffer(buf, dtype=_PLAIN_DTYPES[qtype], count=count, offset=start).reshape(shape)
        else:
            raw = np.frombuffer(buf, dtype=np.uint8, count=n_rows * row_bytes, offset=start)
            data = raw.reshape(*shape[:-1], row_bytes)
        tensors.append(GGUFTensor(name, qtype, shape, data, start))
    return metadata, tensors
