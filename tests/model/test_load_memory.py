"""Loading a GGUF holds about one tensor of the file in memory at a time, beside what the model keeps:
each tensor's mapped pages leave the resident set once it is copied out, and fusing q|k|v and gate|up
frees each layer's unfused weights as it goes."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from kiln.bench.synthetic_gguf import write_synthetic_gguf
from kiln.model import decode_stack, gguf_loader, kernels
from kiln.model.gguf_file import read_gguf
from kiln.model.loader import load_model

SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs /proc/self/smaps (Linux)")


def mapped_resident_bytes(address: int) -> int:
    """The resident bytes of this process's mapping that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def resident_pages(t: torch.Tensor) -> int:
    """How many of the pages `t`'s bytes span are resident (mincore(2))."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    count = -(-(t.data_ptr() + t.nbytes - start) // page)
    vec = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the synthetic tiny body: a 10 MB Q6_K embedding (SmolLM2's 49152 tokens) and 2 small layers
    return write_synthetic_gguf(tmp_path_factory.mktemp("mem") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")


def test_a_released_tensor_leaves_the_resident_set_and_reads_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)   # 4 MB
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = read_gguf(path)
    (t,) = f.tensors
    address = t.data.ctypes.data
    assert float(t.data.sum()) == pytest.approx(float(w.sum()), rel=1e-4)   # every page read
    assert mapped_resident_bytes(address) >= w.nbytes
    f.release(t)
    assert mapped_resident_bytes(address) < w.nbytes // 16
    np.testing.assert_array_equal(t.data, w)   # faulted back in from the file


def test_loading_holds_about_one_tensor_of_the_file_at_a_time(q4_k_m: Path, monkeypatch) -> None:
    resident: list[int] = []
    real = gguf_loader._load_tensor

    def spy(t, *args):
        # before each tensor is read: what the tensors already loaded still hold of the mapping
        resident.append(mapped_resident_bytes(t.data.ctypes.data))
        return real(t, *args)

    monkeypatch.setattr(gguf_loader, "_load_tensor", spy)
    tensors = read_gguf(q4_k_m).tensors
    largest = max(t.data.nbytes for t in tensors)
    assert sum(t.data.nbytes for t in tensors) > 10 << 20 and largest > 8 << 20
    gguf_loader.load_gguf(str(q4_k_m), torch.float32, packed={})
    assert len(resident) == len(tensors)
    # a few pages around the boundaries at most, never the embedding's 10 MB the first tensor read
    assert max(resident) < 1 << 20, resident


def test_fusing_frees_each_layers_unfused_blocks_before_the_next(q4_k_m: Path, monkeypatch) -> None:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    originals: list[weakref.ref] = []
    alive_at_each_fuse: list[int] = []
    real = decode_stack._fuse

    def spy(linears):
        alive_at_each_fuse.append(sum(r() is not None for r in originals))
        parts = [weakref.ref(lin.packed.qs) for lin in linears if getattr(lin, "packed", None) is not None]
        fused = real(linears)
        if fused is not None:   # the linears' blocks are views of the fused weight now
            originals.extend(parts)
        return fused

    monkeypatch.setattr(decode_stack, "_fuse", spy)
    model, _ = load_model(q4_k_m, quantization="gguf")
    assert originals, "the projections were served from their blocks"
    assert model.model.layers[0].mlp.fused_gate_up is not None
    # the loader keeps no reference of its own: the weights a fuse replaced are gone by the next one
    assert alive_at_each_fuse == [0] * len(alive_at_each_fuse)


def test_fused_projections_are_packed_in_place_with_no_copy(q4_k_m: Path, monkeypatch) -> None:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    planned: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    real = gguf_loader.fused_slots

    def spy(tensors):
        planned.update(real(tensors))
        return planned

    monkeypatch.setattr(gguf_loader, "fused_slots", spy)
    model, _ = load_model(q4_k_m, quantization="gguf")
    assert "blk.0.ffn_gate.weight" in planned and "blk.0.ffn_up.weight" in planned
    for i, layer in enumerate(model.model.layers):
        fused = layer.mlp.fused_gate_up
        assert fused is not None
        # the fused weight is the buffer the loader packed gate and up into
        gate_qs, gate_scales = planned[f"blk.{i}.ffn_gate.weight"]
        assert fused.weight.qs.data_ptr() == gate_qs.data_ptr()
        assert fused.weight.scales.data_ptr() == gate_scales.data_ptr()
        assert layer.mlp.up_proj.packed.qs.data_ptr() == planned[f"blk.{i}.ffn_up.weight"][0].data_ptr()


def test_the_kv_pool_reads_as_zeros_and_holds_memory_only_where_written() -> None:
    from kiln.model.config import ModelConfig
    from kiln.model.kv_cache import KVCache

    cfg = ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 256,
                                    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 1000})
    cache = KVCache(cfg, num_blocks=256, block_size=16, dtype=torch.bfloat16, device="cpu")
    pool = cache.storage
    assert pool.nbytes == 4 * 2 * 256 * 16 * 2 * 64 * 2   # 8 MiB
    assert resident_pages(pool) == 0
    cache.k[1][5] = 1.0
    assert resident_pages(pool) == 1   # the page written
    assert float(pool.float().sum()) == cache.k[1][5].numel()   # the rest reads as zeros
