"""GGUF files load to the weights of the HF checkpoint they were converted from."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import IQ4_NL, dequantize, quantize

from kiln.model.config import ModelConfig, UnsupportedModelError
from kiln.model.gguf_file import read_gguf, read_gguf_tensor_infos
from kiln.model.gguf_loader import dequantize_tensor, hf_name
from kiln.model.loader import load_model, load_weights
from kiln.model.rope import rope_inv_freq

from .conftest import make_hf

Q = GGMLQuantizationType
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rows reordered for interleaved rotary."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{leaf}"


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks `[rows, K / 32 * 18]` of float `w [rows, K]` (gguf.quants cannot write them): per
    32 values a float16 d (the largest magnitude maps to the table's -127) and 16 bytes of 4-bit indices
    into IQ4_NL's table, values 0-15 in the low nibbles and 16-31 in the high ones."""
    table = np.array(IQ4_NL.kvalues, dtype=np.float32)
    b = w.astype(np.float32).reshape(-1, 32)
    d = (b[np.arange(len(b)), np.abs(b).argmax(1)] / -127).astype(np.float16)
    df = d.astype(np.float32)
    q = np.abs(b[:, :, None] / np.where(df == 0, 1, df)[:, None, None] - table).argmin(-1).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def write_llama_gguf(path: Path, hf: torch.nn.Module, quant: GGMLQuantizationType, tied: bool = False) -> None:
    cfg = hf.config
    kiln_cfg = ModelConfig.from_hf_dict(cfg.to_dict())
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    if kiln_cfg.rope_scaling is not None:
        # llama.cpp stores llama3 rope scaling as per-frequency divisors in a rope_freqs tensor
        base, _ = rope_inv_freq(dataclasses.replace(kiln_cfg, rope_scaling=None))
        scaled, _ = rope_inv_freq(kiln_cfg)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy())
    for name, t in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        w = t.float().numpy()
        if ".q_proj." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if w.ndim == 2 and quant != Q.F32 and w.shape[1] % 32 == 0:
            blocks = quantize_iq4_nl(w) if quant == Q.IQ4_NL else quantize(w, quant)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama_hf() -> torch.nn.Module:
    return make_hf("llama")


def test_f32_gguf_loads_the_hf_weights_exactly(tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama_hf, Q.F32)
    loaded = load_weights(path, "float32")
    assert loaded.format == "gguf"
    assert not loaded.config.tie_word_embeddings
    reference = llama_hf.state_dict()
    assert set(loaded.tensors) == set(reference)
    for name, t in reference.items():
        torch.testing.assert_close(loaded.tensors[name], t, atol=0, rtol=0, msg=name)


def test_f32_gguf_logits_match_transformers(tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama_hf, Q.F32)
    model, _ = load_model(path, dtype="float32")
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), llama_hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_q8_0_gguf_dequantizes_and_unpermutes(tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    path = tmp_path / "tiny-q8.gguf"
    write_llama_gguf(path, llama_hf, Q.Q8_0)
    loaded = load_weights(path, "float32")
    q = llama_hf.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
    roundtrip = dequantize(quantize(q, Q.Q8_0), Q.Q8_0)  # row order does not change Q8_0 blocks
    got = loaded.tensors["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(got, torch.from_numpy(roundtrip), atol=0, rtol=0)
    model, _ = load_model(path, dtype="float32")
    ids = torch.randint(0, 96, (1, 15), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ours, ref = model.forward_dense(ids), llama_hf(ids).logits
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)


def test_iq4_nl_gguf_dequantizes_unpermutes_and_serves_q8_0_tiles_of_its_values(
        tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    path = tmp_path / "tiny-iq4_nl.gguf"
    write_llama_gguf(path, llama_hf, Q.IQ4_NL)
    loaded = load_weights(path, "float32")
    assert loaded.tensor_types["model.layers.1.self_attn.q_proj.weight"] == "IQ4_NL"
    q = llama_hf.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy()
    roundtrip = dequantize(quantize_iq4_nl(q), Q.IQ4_NL)  # row order does not change IQ4_NL blocks
    got = loaded.tensors["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(got, torch.from_numpy(roundtrip), atol=0, rtol=0)
    # served from its blocks (8-bit activations read the codes through the table; float32 ones multiply
    # q8_0 tiles of the same values), and the log says so; "none" serves the dequantized weights dense
    for quantization, words in (("gguf-float", "its blocks as q8_0 tiles of their values, float32"),
                                ("gguf", "its blocks as iq4_nl, 8-bit"), ("none", "dense")):
        model, weights = load_model(path, quantization=quantization)
        parts = [p for p in weights.served.split("; ") if p.startswith("IQ4_NL x")]
        assert parts and all(words in p for p in parts), weights.served
        if quantization != "none":
            proj = model.get_submodule("model.layers.1.self_attn.q_proj")
            assert torch.equal(proj.packed.dequantize(), got)
    # the logits are the HF model's with every quantized weight replaced by its dequantization
    reference = copy.deepcopy(llama_hf)
    with torch.no_grad():
        for _, w in reference.named_parameters():
            if w.dim() == 2 and w.shape[1] % 32 == 0:
                w.copy_(torch.from_numpy(dequantize(quantize_iq4_nl(w.numpy()), Q.IQ4_NL)))
    ids = torch.randint(0, 96, (1, 15), generator=torch.Generator().manual_seed(9))
    model, _ = load_model(path, dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_q5_0_gguf_serves_q8_0_tiles_of_its_values(tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    # llama-quantize's fallback for Q4_K rows that are not whole superblocks of 256
    path = tmp_path / "tiny-q5_0.gguf"
    write_llama_gguf(path, llama_hf, Q.Q5_0)
    dense = load_weights(path, "float32").tensors["model.layers.1.self_attn.q_proj.weight"]
    for quantization, words in (("gguf", "its blocks as q8_0 tiles of their values, 8-bit"),
                                ("gguf-float", "its blocks as q8_0 tiles of their values, float32")):
        model, weights = load_model(path, quantization=quantization)
        parts = [p for p in weights.served.split("; ") if p.startswith("Q5_0 x")]
        assert parts and all(words in p for p in parts), weights.served
        assert torch.equal(model.get_submodule("model.layers.1.self_attn.q_proj").packed.dequantize(), dense)


def test_gguf_rope_freqs_tensor_reproduces_llama3_scaling(tmp_path: Path) -> None:
    hf = make_hf("llama3_rope")
    path = tmp_path / "llama3.gguf"
    write_llama_gguf(path, hf, Q.F32)
    model, loaded = load_model(path, dtype="float32")
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_gguf_without_output_tensor_is_tied(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    llama = make_hf("llama")
    llama.lm_head.weight = llama.model.embed_tokens.weight
    write_llama_gguf(path, llama, Q.F32, tied=True)
    model, loaded = load_model(path, dtype="float32")
    assert loaded.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), llama(ids).logits, atol=1e-4, rtol=1e-4)


def test_gguf_metadata_is_plain_python(tmp_path: Path, llama_hf: torch.nn.Module) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama_hf, Q.F32)
    md = load_weights(path, "float32").gguf_metadata
    assert md is not None
    assert md["tokenizer.ggml.tokens"][:3] == ["t0", "t1", "t2"]
    assert md["tokenizer.ggml.bos_token_id"] == 1
    assert md["tokenizer.chat_template"] == "{{ messages }}"
    assert md["general.architecture"] == "llama"
    assert not any(k.startswith("GGUF.") for k in md)


def test_the_metadata_is_handed_over_before_any_tensor_loads_and_a_cancel_stops_the_load(
        tmp_path: Path, llama_hf: torch.nn.Module, monkeypatch) -> None:
    import threading

    from kiln.model import gguf_loader

    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama_hf, Q.F32)
    events: list[str] = []
    real = gguf_loader._load_tensor
    monkeypatch.setattr(gguf_loader, "_load_tensor", lambda t, *a: (events.append(t.name), real(t, *a))[1])
    loaded = load_weights(path, "float32", on_metadata=lambda md: events.append(f"metadata {md['general.architecture']}"))
    assert events[0] == "metadata llama" and len(events) == 1 + len(loaded.tensors)
    cancel = threading.Event()
    events.clear()

    def stop_after_two(t, *a):
        events.append(t.name)
        if len(events) == 2:
            cancel.set()
        return real(t, *a)

    monkeypatch.setattr(gguf_loader, "_load_tensor", stop_after_two)
    with pytest.raises(gguf_loader.LoadCancelled):
        load_weights(path, "float32", cancel=cancel)
    assert len(events) == 2


def test_unsupported_quant_type_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "q2_k.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64),
                       ("attention.head_count", 4), ("context_length", 64), ("vocab_size", 32)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 84), dtype=np.uint8), raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"Q2_K.*supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        load_weights(path, "float32")


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.2.attn_k_norm.weight") == "model.layers.2.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(UnsupportedModelError):
        hf_name("blk.0.ffn_gate_exps.weight")


def test_every_supported_type_reads_like_gguf_reader(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 6])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    writer.add_tensor("f32", w)
    writer.add_tensor("f16", w.astype(np.float16))
    # Q5_0 / Q5_1: what llama-quantize writes for a K-quant tensor whose rows are not whole superblocks
    for q in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        writer.add_tensor(q.name.lower(), quantize(w, q), raw_dtype=q)
    # K-quants cannot be produced by gguf.quants: random blocks still exercise shapes and offsets
    writer.add_tensor("q4_k", rng.integers(0, 255, (3, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)
    writer.add_tensor("q6_k", rng.integers(0, 255, (2, 2 * 210), dtype=np.uint8), raw_dtype=Q.Q6_K)
    # nor IQ4_NL (18 bytes a block of 32) / IQ4_XS (136 a superblock of 256)
    writer.add_tensor("iq4_nl", rng.integers(0, 255, (3, 8 * 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    writer.add_tensor("iq4_xs", rng.integers(0, 255, (2, 136), dtype=np.uint8), raw_dtype=Q.IQ4_XS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = read_gguf(path)
    reader = GGUFReader(str(path))
    expected_md = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected_md
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.name == theirs.name and mine.qtype == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        want = dequantize(np.asarray(theirs.data), theirs.tensor_type).reshape(mine.shape)
        got = dequantize_tensor(mine)
        assert got.shape == mine.shape
        np.testing.assert_array_equal(got.numpy(), want, err_msg=mine.name)
    assert ours.tensors[0].shape == (4, 256)
    assert ours.tensors[-3].shape == (2, 512)
    assert ours.tensors[-2].shape == (3, 256) and ours.tensors[-1].shape == (2, 256)


def test_tensor_infos_follow_the_file_when_it_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "infos.gguf"

    def write(rows: int) -> None:
        writer = GGUFWriter(str(path), "llama")
        writer.add_tensor("w", np.zeros((rows, 64), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write(2)
    (info,) = read_gguf_tensor_infos(path)
    assert (info.name, info.qtype, info.shape) == ("w", Q.F32, (2, 64))
    write(3)   # a new size: a new version of the file, parsed again
    assert read_gguf_tensor_infos(path)[0].shape == (3, 64)
