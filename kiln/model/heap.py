"""The process's memory: the C heap's freed pages handed back to the system, and zero-filled tensors
whose pages the kernel supplies on first write.

glibc serves allocations of a few MB to a few tens of MB from its heap (its mmap threshold rises to 32 MB
after the first large free) and keeps the pages once they are freed: the loader's packing temporaries
(~620 MB at a 1B Q8_0 file) and a served prompt's (~100 MB at 1B) would stay in the resident set. The
loader trims after each tensor it copies out of the file and after fusing; the engine when it goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
from collections.abc import Sequence
from typing import Any

import torch


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc: nothing to trim
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def zeroed(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on an anonymous private mapping: its pages read as zeros and take memory
    (and the time to clear them) only once written. `torch.zeros` writes every byte at once: for a
    512 MiB KV pool ~0.3 s of a 1B model's start on 2 cores, and the whole pool resident from the start
    though most of it waits for traffic. Where there is no anonymous mmap (not Unix), `torch.zeros`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(*shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `pages` alive as long as the tensor (and any view of it) lives
    return torch.frombuffer(pages, dtype=dtype).view(*shape)
