"""The weights' memory: tensors in 2 MiB pages (heap.huge_paged) behave as torch.empty's, and the
kernel may back them with transparent huge pages."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from kiln.model.heap import HUGE_PAGE, huge_paged, huge_paged_cat, huge_paged_copy


def _thp_available() -> bool:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and mode.exists()
            and "[never]" not in mode.read_text())


linux_thp = pytest.mark.skipif(not _thp_available(), reason="needs Linux with transparent huge pages")


def _mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds t's first byte."""
    addr = t.data_ptr()
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
            continue
        if inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_a_large_tensor_is_zeros_of_the_asked_shape_and_dtype_aligned_to_a_huge_page() -> None:
    t = huge_paged((3, 1 << 20), torch.uint8)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * 3 * (1 << 20)


def test_the_memory_lives_as_long_as_a_view_of_it() -> None:
    t = huge_paged((HUGE_PAGE // 4 + 5,), torch.float32)
    view = t[-5:]
    del t
    view.copy_(torch.arange(5, dtype=torch.float32))
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_small_tensor_is_an_ordinary_one() -> None:
    t = huge_paged((16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and t.dtype == torch.bfloat16


@linux_thp
def test_the_kernel_may_back_a_large_tensor_with_huge_pages() -> None:
    t = huge_paged((4 * HUGE_PAGE,), torch.uint8)
    assert _mapping_of(t).get("THPeligible") == "1"


def test_concatenation_and_copies_keep_the_values() -> None:
    parts = [torch.randint(0, 255, (n, 1024, 1024), dtype=torch.uint8) for n in (1, 2)]
    joined = huge_paged_cat(parts)
    assert torch.equal(joined, torch.cat(parts))
    strided = parts[1].permute(2, 1, 0)
    copy = huge_paged_copy(strided)
    assert copy.is_contiguous() and torch.equal(copy, strided)
