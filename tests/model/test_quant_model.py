"""Serving a GGUF with its own quantized blocks: exact weights, q/k permutation undone, close logits."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import load_model

from .conftest import make_hf
from .test_gguf import write_llama_gguf


def _paged_logits(model, ids: list[int], packed_ok: bool) -> torch.Tensor:
    cache = KVCache(model.config, 8, 4, torch.float32, torch.device("cpu"))
    meta, pos = build_attention_metadata([(list(range(8)), 0, len(ids))], 4, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), meta, cache)
        return model.compute_logits(hidden, packed_ok=packed_ok)


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_1, Q.Q4_0])
def test_gguf_quantization_packs_the_stored_blocks_exactly(tmp_path, quant):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), quant)
    model, weights = load_model(path, dtype="float32", quantization="gguf")
    reference, _ = load_model(path, dtype="float32", quantization="none")
    assert weights.quantization == "gguf"
    packed = {n: m.packed for n, m in model.named_modules() if hasattr(m, "packed")}
    assert "model.layers.0.self_attn.q_proj" in packed and "model.layers.1.self_attn.k_proj" in packed
    for name, pw in packed.items():
        dense = reference.get_submodule(name).weight.float()
        assert torch.equal(pw.dequantize(torch.float32), dense), name


def test_gguf_quantized_paged_logits_track_the_dense_ones(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q8_0)
    model, _ = load_model(path, dtype="float32", quantization="gguf")
    ids = [3, 14, 15, 9, 26, 5, 35]
    dense = _paged_logits(model, ids, packed_ok=False)
    quant = _paged_logits(model, ids, packed_ok=True)
    # only the 8-bit activations differ; a wrong row permutation would be far off
    assert (quant - dense).abs().max() < 0.05 * dense.abs().max()
    # the dense path (training, scoring) never uses the packed weights
    assert torch.equal(model.forward_dense(torch.tensor([ids]))[0], model.forward_dense(torch.tensor([ids]))[0])


def test_default_is_the_dense_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q8_0)
    model, weights = load_model(path, dtype="float32")
    assert weights.quantization == "none"
    assert not any(hasattr(m, "packed") for m in model.modules())


def test_q8_0_quantizes_an_hf_checkpoint(tiny_llama, tmp_path):
    model, weights = load_model(tiny_llama.path, dtype="float32", quantization="q8_0")
    assert weights.quantization == "q8_0"
    ids = [5, 6, 7, 8]
    dense = _paged_logits(model, ids, packed_ok=False)
    quant = _paged_logits(model, ids, packed_ok=True)
    assert (quant - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("quant", [Q.Q8_0, Q.Q4_1])
def test_gguf_float_serves_the_blocks_with_float_activations(tmp_path, quant):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), quant)
    model, weights = load_model(path, dtype="float32", quantization="gguf-float")
    assert weights.quantization == "gguf-float"
    assert all(m.packed.float_act for m in model.modules() if getattr(m, "packed", None) is not None)
    ids = [3, 14, 15, 9, 26, 5, 35]
    dense = _paged_logits(model, ids, packed_ok=False)
    served = _paged_logits(model, ids, packed_ok=True)
    # the dense weights are the blocks dequantized: only float32 summation order differs
    assert (served - dense).abs().max() < 1e-4 * dense.abs().max()


def test_auto_keeps_a_quantized_gguf_packed_with_float32_activations_on_the_avx2_kernels(tmp_path):
    from kiln.model import kernels
    from kiln.model.loader import resolve_quantization

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    with kernels.using_isa("avx2"):
        assert resolve_quantization(path) == "gguf-float"
        assert resolve_quantization(path, "cuda") == "none"
        model, weights = load_model(path, quantization="auto")
    assert weights.quantization == "gguf-float" and model.dtype == torch.float32


def test_auto_serves_the_dense_weights_where_decode_rebuilds_bfloat16_and_vdpbf16ps_is_fast(tmp_path, monkeypatch):
    from kiln.model import kernels, loader

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    monkeypatch.setattr(loader, "codes_serve_here", lambda: True)   # AVX512-BF16
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert loader.resolve_quantization(path) == "none"


def test_auto_keeps_the_blocks_with_float_activations_where_vdpbf16ps_is_slower_than_fmas(tmp_path, monkeypatch):
    from kiln.model import kernels, loader

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    monkeypatch.setattr(loader, "codes_serve_here", lambda: True)   # AVX512-BF16, from Intel
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "GenuineIntel")
    assert loader.resolve_quantization(path) == "gguf-float"


@pytest.mark.parametrize(("isa", "bf16_codes", "vendor", "says"), [
    ("avx512", True, "GenuineIntel", "half its float32 FMAs' rate"),
    ("avx2", False, "AuthenticAMD", "no native bfloat16 dot products on the avx2 kernels"),
    ("avx512", True, "AuthenticAMD", "outpaces its float32 FMAs"),
])
def test_the_startup_log_says_why_auto_chose_the_weights(tmp_path, monkeypatch, isa, bf16_codes, vendor, says):
    from kiln.model import kernels, loader

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    monkeypatch.setattr(kernels, "active_isa", lambda: isa)
    monkeypatch.setattr(loader, "codes_serve_here", lambda: bf16_codes)
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: vendor)
    reason = loader.auto_quantization_reason(path)
    assert reason is not None and says in reason and "--quantization" in reason


def test_auto_explains_nothing_for_a_dense_model(tmp_path):
    from kiln.model import loader

    path = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.F32)
    assert loader.auto_quantization_reason(path) is None


def test_auto_serves_the_dense_weights_without_the_kernels(tmp_path, monkeypatch):
    from kiln.model import kernels, loader

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    monkeypatch.setattr(loader, "codes_serve_here", lambda: False)
    monkeypatch.setattr(kernels, "dense_bf16_fast", lambda: False)
    assert loader.resolve_quantization(path) == "none"


def test_auto_serves_dense_weights_where_nothing_is_packable(tmp_path, tiny_llama):
    from kiln.model.loader import resolve_quantization

    path = tmp_path / "tiny-f32.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.F32)
    assert resolve_quantization(path) == "none"
    assert resolve_quantization(tiny_llama.path) == "none"
    _, weights = load_model(path, dtype="float32", quantization="auto")
    assert weights.quantization == "none"


def test_gguf_step_asked_for_its_sampled_rows_gives_them_bit_for_bit(tmp_path):
    # the quantized kernels are batch invariant, so skipping the last layer's other rows changes no bit
    from kiln.model import kernels

    from .test_paged import _some_rows_and_the_whole_step

    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, make_hf("llama"), Q.Q4_1)
    model, _ = load_model(path, dtype="bfloat16", quantization="gguf")
    some, want, some_cache, whole_cache = _some_rows_and_the_whole_step(model)
    assert torch.equal(some, want)
    assert torch.equal(some_cache.storage, whole_cache.storage)
