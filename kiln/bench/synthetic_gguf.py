"""Random-weight GGUF files with a real model's shapes, for measuring at real sizes without downloading
weights: `python -m kiln.bench.synthetic_gguf 1b out.gguf [--type f16|q4_k_m|q6_k|q8_0]`.

The body is llama's (SmolLM2's, Llama 3.2's and 3.1's shapes), the tokenizer and chat template the
embedded SmolLM2's (copied from its GGUF, so the vocabulary is its 49152 tokens). `f16` writes float16
weights that llama.cpp's `llama-quantize` turns into any of its formats; `q4_k_m`, `q5_k_m`, `q6_k` and
`q8_0` write random blocks of those types directly (Q4_K_M / Q5_K_M with llama.cpp's per-tensor choice:
Q6_K for the output / tied embedding and for attn_v and ffn_down in its "more bits" layers, Q4_K / Q5_K
elsewhere), which
exercise the same kernels and bytes as quantized weights. Tensors are streamed to the file one at a
time (an 8B F16 file is 16 GB; the process holds one tensor).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

Q = GGMLQuantizationType


@dataclass(frozen=True)
class Body:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool


BODIES = {
    # whole superblocks of 256 along every K, so every projection can be a K-quant
    "tiny": Body(256, 2, 4, 2, 512, True),
    "0.5b": Body(1024, 24, 16, 4, 4096, True),
    "1b": Body(2048, 16, 32, 8, 8192, True),      # Llama 3.2 1B
    "3b": Body(3072, 28, 24, 8, 8192, True),      # Llama 3.2 3B
    "8b": Body(4096, 32, 32, 8, 14336, False),    # Llama 3.1 8B
}
TYPES = ("f16", "q4_k_m", "q5_k_m", "q6_k", "q8_0")


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, kind: str, layer: int, layers: int, tied: bool) -> GGMLQuantizationType:
    if kind == "f16":
        return Q.F16
    if kind == "q6_k":
        return Q.Q6_K
    if kind == "q8_0":
        return Q.Q8_0
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q6_K
    if (".attn_v." in name or ".ffn_down." in name) and _more_bits(layer, layers):
        return Q.Q6_K
    return Q.Q5_K if kind == "q5_k_m" else Q.Q4_K


def tensor_shapes(body: Body, vocab: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(GGUF name, torch-order shape, layer or -1) of every tensor, in file order."""
    h, d = body.hidden, body.hidden // body.heads
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (vocab, h), -1)]
    for i in range(body.layers):
        for name, shape in [("attn_norm", (h,)), ("attn_q", (body.heads * d, h)), ("attn_k", (body.kv_heads * d, h)),
                            ("attn_v", (body.kv_heads * d, h)), ("attn_output", (h, body.heads * d)),
                            ("ffn_norm", (h,)), ("ffn_gate", (body.ffn, h)), ("ffn_up", (body.ffn, h)),
                            ("ffn_down", (h, body.ffn))]:
            out.append((f"blk.{i}.{name}.weight", shape, i))
    out.append(("output_norm.weight", (h,), -1))
    if not body.tied:
        out.append(("output.weight", (vocab, h), -1))
    return out


def _random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random codes whose values are about N(0, 0.02) in size (a real layer's scale)."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    nb = rows * k // block
    b = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)

    def f16(scale: float) -> np.ndarray:
        return np.full(nb, scale, np.float16).view(np.uint8).reshape(nb, 2)

    if qtype == Q.Q4_K:        # d * sc * q - dmin * m, sc, m < 64, q < 16
        b[:, 0:2], b[:, 2:4] = f16(8e-5), f16(4e-5)
    elif qtype == Q.Q5_K:      # as Q4_K with q < 32
        b[:, 0:2], b[:, 2:4] = f16(4e-5), f16(4e-5)
    elif qtype == Q.Q6_K:      # d * sc * (q - 32), sc int8
        b[:, 208:210] = f16(2e-5)
    elif qtype == Q.Q8_0:      # d * q, q int8
        b[:, 0:2] = f16(3e-4)
    return b


def _write_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy the tokenizer.* fields of `source`; returns its vocabulary size."""
    reader = GGUFReader(str(source))
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(name, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
            if name == "tokenizer.ggml.tokens":
                vocab = len(value)
        else:
            writer.add_key_value(name, value, field.types[0])
    return vocab


def write_synthetic_gguf(path: str | Path, size: str, kind: str = "f16", seed: int = 0,
                         tokenizer_from: str | Path | None = None) -> Path:
    """Write a random-weight llama GGUF of body `size` (BODIES) as `kind` (TYPES) to `path`."""
    if size not in BODIES:
        raise ValueError(f"size must be one of {', '.join(BODIES)}, got {size!r}")
    if kind not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, got {kind!r}")
    if tokenizer_from is None:
        from kiln.model.loader import default_model_path

        tokenizer_from = default_model_path()
    body, path = BODIES[size], Path(path)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    vocab = _write_tokenizer(writer, Path(tokenizer_from))
    writer.add_name(f"kiln synthetic llama {size} {kind}")
    writer.add_block_count(body.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(body.hidden)
    writer.add_feed_forward_length(body.ffn)
    writer.add_head_count(body.heads)
    writer.add_head_count_kv(body.kv_heads)
    writer.add_rope_dimension_count(body.hidden // body.heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"f16": 1, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q8_0": 7}[kind])
    shapes = tensor_shapes(body, vocab)
    types = []
    for name, shape, layer in shapes:
        qtype = Q.F32 if len(shape) == 1 else tensor_type(name, kind, layer, body.layers, body.tied)
        types.append(qtype)
        block, nbytes = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        writer.add_tensor_info(name, shape, np.dtype(np.float32 if qtype == Q.F32 else np.float16),
                               n // block * nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (_, shape, _), qtype in zip(shapes, types, strict=True):
        if qtype == Q.F32:   # norms: around one, as trained models have them
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif qtype == Q.F16:
            data = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)
        else:
            data = _random_blocks(qtype, shape[0], shape[1], rng)
        writer.write_tensor_data(data)
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", choices=list(BODIES))
    parser.add_argument("out")
    parser.add_argument("--type", choices=TYPES, default="f16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_synthetic_gguf(args.out, args.size, args.type, args.seed)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
