"""The C heap's freed pages, handed back to the system.

glibc serves allocations of a few MB to a few tens of MB from its heap (its mmap threshold rises to 32 MB
after the first large free) and keeps the pages once they are freed: the loader's packing temporaries
(~620 MB at a 1B Q8_0 file) and a served prompt's (~100 MB at 1B) would stay in the resident set. The
loader trims after each tensor it copies out of the file and after fusing; the engine when it goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


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
