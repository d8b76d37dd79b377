"""The process's memory: the C heap's freed pages handed back to the system, zero-filled tensors
whose pages the kernel supplies on first write, and the weights' memory in 2 MiB pages.

glibc serves allocations of a few MB to a few tens of MB from its heap (its mmap threshold rises to 32 MB
after the first large free) and keeps the pages once they are freed: the loader's packing temporaries
(~620 MB at a 1B Q8_0 file) and a served prompt's (~100 MB at 1B) would stay in the resident set. The
loader trims after each tensor it copies out of the file and after fusing; the engine when it goes idle.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
from collections.abc import Sequence
from typing import Any

import torch

HUGE_PAGE = 2 << 20   # x86-64's transparent huge page


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


def huge_paged(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor (zeros) for weights that decode streams every token: its own anonymous mapping,
    aligned to 2 MiB and advised MADV_HUGEPAGE, so the kernel backs each whole 2 MiB of it with one
    transparent huge page (Linux's default `madvise` mode grants them only where asked). A decode step
    reads every weight once, and with 4 KiB pages it crosses a page every 4 KiB: a TLB miss each, and
    the hardware prefetchers stop at every page boundary. The K-quant GEMV on a 2-core AMD EPYC (Zen 4),
    weights past the L3, AVX2 and AVX-512: one thread 5-50% more GB/s, two threads 5-18%. The tail past
    the last whole 2 MiB keeps small pages (nothing is resident that the tensor does not use). Below
    2 MiB, or where there is no MADV_HUGEPAGE (not Linux), `torch.empty`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(*shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `pages` alive as long as the tensor (and any view of it) lives
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):   # a kernel without transparent huge pages: small pages
        pages.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    return whole[start:start + nbytes].view(dtype).view(*shape)


def huge_paged_cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` (along dim 0) into `huge_paged` memory."""
    shape = (sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:])
    return torch.cat(list(parts), out=huge_paged(shape, parts[0].dtype))


def huge_paged_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` (any strides) as a contiguous tensor in `huge_paged` memory."""
    return huge_paged(t.shape, t.dtype).copy_(t)
