"""What `--quantization auto` serves a model with: a pure decision over facts about the CPU and the file.

The loader (`kiln.model.loader.resolve_quantization`) gathers the facts (the kernels' ISA, whether
vdpbf16ps outpaces float32 FMAs, the GGUF's tensor types and sizes); this module only decides, so the
rule is tested without a model or a CPU of each kind.

The rule, by bytes moved per token:
- no GGUF, a GPU, or no CPU kernels: the dense weights ("none").
- projections mostly K-quant blocks (Q4_K_M, Q5_K_M, Q6_K files): their blocks with 8-bit activations
  ("gguf", llama.cpp's arithmetic) on every CPU the kernels run on. Dense bfloat16 cannot be rebuilt
  from them and would stream 3-4x their bytes every decode step.
- projections mostly Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks (Q5_0 served as q8_0 tiles of its values):
  - at real sizes (a dense bfloat16 copy over `DENSE_MAX_BYTES`), the blocks with 8-bit activations
    ("gguf") on every CPU, as for a K-quant file: a decode step streams the file's bytes, int8 dot
    products (VNNI, AVX2's maddubs) keep prompts and batches fast, and nothing dense is held (a 1B Q8_0
    would keep a 2.5 GB dense copy beside its 1.1 GB of blocks). Float32 activations are compute-bound
    there: on a 1B Q8_0 with the AVX2 kernels (2-core Zen 4, the serving bench) gguf was 1.1x
    gguf-float at one stream, 1.6-2.9x on prompts and 1.8-2.0x at 8 / 32 streams.
  - a small model (a model that sits in the caches, where bytes per token do not bind): float
    activations, the dequantized weights' answers, because 8-bit activations move a small model's
    logits enough to change what it says (the embedded SmolLM2-135M Q4_1 served as "gguf" no longer
    answers "Paris" to "What is the capital of France?"). Where decode rebuilds bfloat16 from the
    blocks and vdpbf16ps outpaces float32 FMAs (AMD's AVX512-BF16): dense bfloat16 ("none"; decode
    reads the blocks' codes anyway, and vdpbf16ps gives prompts and batches twice float32's rate; on
    SmolLM2-135M Q4_1, 270 MB in bfloat16, 1.09x / 1.49x llama-server at one stream and 4.08x / 4.89x
    at 8 / 32 streams on a 2-core Zen 4). Anywhere else the kernels run (AVX2; Intel's AVX512-BF16,
    whose vdpbf16ps has half its FMAs' rate): the blocks with float32 activations ("gguf-float", from
    a third of bfloat16's bytes).
- projections mostly IQ4_NL / IQ4_XS blocks: their blocks with 8-bit activations ("gguf") on every CPU,
  as for K-quants: the kernel reads their 4-bit codes through IQ4's table; float32 activations would
  multiply q8_0 tiles of the same values (twice the bytes), dense bfloat16 3.5x.
- anything else (F16/F32 files): the dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass

# The largest dense bfloat16 copy of a Q4_0/Q4_1/Q8_0 GGUF that "auto" serves with float activations (a
# small model, whose answers 8-bit activations change): SmolLM2-135M (270 MB) fits with room, a 0.5B model
# (about 1 GB) does not.
DENSE_MAX_BYTES = 512 << 20


@dataclass(frozen=True)
class AutoFacts:
    """What the choice depends on. Element counts are over the layers' 2-D projection weights."""

    on_cpu: bool
    is_gguf: bool
    kernels: bool               # the C++ kernels run here (a dense bfloat16 kernel on AVX2 or AVX-512)
    bf16_wins: bool             # decode rebuilds bfloat16 from the blocks and vdpbf16ps outpaces FMAs
    isa: str                    # the kernels' ISA ("avx512", "avx2", "scalar")
    projection_elements: int
    kquant_elements: int        # of which stored as Q4_K / Q5_K / Q6_K
    packable_elements: int      # of which in a block type the kernels take (K-quants included)
    dense_bytes: int            # every tensor of the file in bfloat16
    iq4_elements: int = 0       # of which stored as IQ4_NL / IQ4_XS


@dataclass(frozen=True)
class AutoChoice:
    quantization: str           # "none" | "gguf" | "gguf-float"
    reason: str | None          # a sentence for the startup log (None: nothing to explain)


def choose(f: AutoFacts) -> AutoChoice:
    """`auto`'s weights for the facts `f`, with the startup log's reason (module docstring)."""
    if not (f.on_cpu and f.is_gguf and f.kernels):
        return AutoChoice("none", None)
    total = f.projection_elements
    if total and f.kquant_elements * 2 >= total:
        return AutoChoice("gguf", (
            "auto serves the GGUF's K-quant blocks with 8-bit activations (gguf, llama.cpp's arithmetic): dense "
            "bfloat16 cannot be rebuilt from them and would stream 3-4x their bytes a decode step, and float32 "
            "activations are compute-bound; --quantization gguf-float keeps the blocks with float32 activations "
            "(the dequantized model's answers), none serves dense bfloat16"))
    if total and f.iq4_elements * 2 >= total:
        return AutoChoice("gguf", (
            "auto serves the GGUF's IQ4_NL/IQ4_XS blocks with 8-bit activations (gguf, llama.cpp's arithmetic): the "
            "kernels read their 4-bit codes through IQ4's table; --quantization gguf-float multiplies q8_0 tiles of "
            "the same values with float32 activations (twice the bytes), none serves dense bfloat16"))
    # most of the layers' weights in blocks the kernels take (a projection whose K is not whole groups of
    # 32 stays dense, as GGUF writers store it unquantized)
    if not (total and f.packable_elements * 2 >= total):
        return AutoChoice("none", None)
    mb = f.dense_bytes / (1 << 20)
    limit = DENSE_MAX_BYTES >> 20
    if f.dense_bytes > DENSE_MAX_BYTES:
        return AutoChoice("gguf", (
            f"auto serves the GGUF's Q4_0/Q4_1/Q5_0/Q8_0 blocks with 8-bit activations (gguf, llama.cpp's arithmetic) "
            f"and keeps no dense copy: one in bfloat16 would take {mb:.0f} MB (over {limit} MB), a decode step "
            f"streams the blocks' bytes, and float32 activations are compute-bound at this size; --quantization "
            f"gguf-float keeps the blocks with float32 activations (the dequantized model's answers), none serves "
            f"dense bfloat16"))
    if f.bf16_wins:
        return AutoChoice("none", (
            f"auto serves dense bfloat16 (decode rebuilds Q4_0/Q4_1/Q8_0 weights from their blocks): this CPU's "
            f"vdpbf16ps outpaces its float32 FMAs and the dense copy is small ({mb:.0f} MB, at most {limit} MB: a "
            f"model this size sits in the caches, so bytes per token do not bind, and 8-bit activations would change "
            f"its answers); --quantization gguf-float keeps only the blocks with float32 activations, gguf with 8-bit "
            f"ones"))
    why = ("this CPU's vdpbf16ps runs at half its float32 FMAs' rate (Intel AVX512-BF16)" if f.isa == "avx512"
           else f"no native bfloat16 dot products on the {f.isa} kernels")
    return AutoChoice("gguf-float", (
        f"auto serves the GGUF's quantized blocks with float32 activations (gguf-float): the dequantized model's "
        f"answers, which 8-bit activations change on a model this small ({mb:.0f} MB in bfloat16), and {why}; "
        "--quantization none serves dense bfloat16, gguf llama.cpp's 8-bit activations"))
