"""Handoff bundles: folders that train this server's LoRA with TRL + PEFT on other machines (SFT, DPO).

`write_sft_bundle` writes: train.jsonl (the rows, `{"messages": [...]}`, TRL's conversational form),
chat_template.jinja (the served model's template, which train.py puts on the tokenizer so training
renders conversations exactly as serving does), kiln_sft.json (base model, LoRA configuration and
the hyperparameters from the same SftConfig a POST /v1/train/sft takes), train.py (SFTTrainer with a
PEFT LoraConfig; saves a PEFT folder), requirements.txt pinned to the versions this server runs, and
README.md with the `accelerate launch` command and how to bring the adapter back
(POST /v1/train/hf/peft/imports/{name}). `write_dpo_bundle` writes the same set for DPOTrainer, with
preference rows `{"prompt": [messages], "chosen": [reply], "rejected": [reply]}` and kiln_dpo.json.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import Field

from kiln.store.atomic import atomic_write_json, atomic_write_text
from kiln.train.requests import CommonConfig, SftConfig

# What train.py imports; pinned to this server's versions when installed here, else to these floors.
REQUIREMENTS = {"torch": "2.4", "transformers": "4.56", "peft": "0.17", "trl": "1.0", "accelerate": "1.0",
                "datasets": "3.0"}

class DpoBundleConfig(CommonConfig):
    """LoRA and hyperparameters of a DPO bundle (trained elsewhere, so nothing here runs them)."""

    learning_rate: float = Field(5e-5, gt=0, allow_inf_nan=False)
    beta: float = Field(0.1, gt=0, allow_inf_nan=False)   # DPO's KL strength


TRAIN_PY = '''"""SFT of a LoRA adapter with TRL's SFTTrainer + PEFT, written by Kiln (see README.md).

    accelerate launch train.py [--base-model PATH_OR_HF_ID] [--output-dir DIR] [--max-steps N]
"""

import argparse
import json
from pathlib import Path

import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

HERE = Path(__file__).resolve().parent


def main() -> None:
    cfg = json.loads((HERE / "kiln_sft.json").read_text())
    parser = argparse.ArgumentParser(description="Train the LoRA adapter Kiln exported.")
    parser.add_argument("--base-model", default=cfg["base_model"], help="HF id or folder of the base model")
    parser.add_argument("--output-dir", default=str(HERE / "adapter"), help="where the PEFT adapter is saved")
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after N optimizer steps (-1: the epochs)")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    # the template the Kiln server renders conversations with, so training sees what serving sends
    tokenizer.chat_template = (HERE / "chat_template.jinja").read_text()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset("json", data_files=str(HERE / "train.jsonl"), split="train")
    hp = cfg["training"]
    on_gpu = torch.cuda.is_available()
    training_args = SFTConfig(
        output_dir=str(HERE / "checkpoints"),
        num_train_epochs=hp["epochs"],
        max_steps=args.max_steps,
        per_device_train_batch_size=hp["batch_size"],
        gradient_accumulation_steps=hp["gradient_accumulation_steps"],
        learning_rate=hp["learning_rate"],
        weight_decay=hp["weight_decay"],
        max_grad_norm=hp["max_grad_norm"],
        max_length=hp["max_seq_len"],
        seed=hp["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=on_gpu and torch.cuda.is_bf16_supported(),  # TRL's default; a CPU trains in float32
        use_cpu=not on_gpu,
    )
    trainer = SFTTrainer(model=args.base_model, args=training_args, train_dataset=dataset,
                         processing_class=tokenizer, peft_config=LoraConfig(**cfg["lora"]))
    trainer.train()
    trainer.save_model(args.output_dir)  # adapter_config.json + adapter_model.safetensors
    print(f"saved the adapter to {args.output_dir}")


if __name__ == "__main__":
    main()
'''


TRAIN_DPO_PY = (TRAIN_PY
                .replace("SFT of a LoRA adapter with TRL's SFTTrainer", "DPO of a LoRA adapter with TRL's DPOTrainer")
                .replace("from trl import SFTConfig, SFTTrainer", "from trl import DPOConfig, DPOTrainer")
                .replace("kiln_sft.json", "kiln_dpo.json")
                .replace("training_args = SFTConfig(", "training_args = DPOConfig(\n        beta=hp[\"beta\"],")
                .replace("trainer = SFTTrainer(", "trainer = DPOTrainer("))


def pinned_requirements() -> str:
    lines = []
    for package, floor in REQUIREMENTS.items():
        try:
            lines.append(f"{package}=={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package}>={floor}")
    return "\n".join(lines) + "\n"


def lora_section(config: CommonConfig) -> dict[str, Any]:
    return {"r": config.lora_rank, "lora_alpha": config.lora_alpha, "target_modules": list(config.target_modules),
            "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}


def readme(name: str, base_model: str, rows: int, kind: str = "sft") -> str:
    what = "training conversations" if kind == "sft" else "preference pairs (prompt, chosen, rejected)"
    config = "kiln_sft.json" if kind == "sft" else "kiln_dpo.json"
    return f"""# {kind.upper()} handoff bundle `{name}`

Written by Kiln: {rows} {what} for a LoRA adapter on `{base_model}`, to train with
TRL + PEFT on any machine (GPUs, several nodes).

    pip install -r requirements.txt
    accelerate launch train.py                      # add --max-steps N for a short trial
    accelerate launch --num_processes 8 train.py    # one process per GPU (run `accelerate config` for more)

Pass `--base-model` when the base model lives at another path or HF id there. The adapter lands in
`adapter/` (adapter_config.json + adapter_model.safetensors). Bring it back to Kiln with

    curl -X POST $KILN/v1/train/hf/peft/imports/{name} -H 'Content-Type: application/json' \\
         -d '{{"path": "/path/to/adapter"}}'

(the server checks it as it checks an upload), or `kiln adapters upload {name} adapter/`.

Files: train.jsonl (the rows), chat_template.jinja (the template Kiln serves with, set on the
tokenizer), {config} (LoRA configuration and hyperparameters), train.py, requirements.txt.
"""


def write_sft_bundle(out: Path, *, name: str, rows: list[dict[str, Any]], chat_template: str, base_model: str,
                     config: SftConfig) -> list[str]:
    """Write the bundle's files into `out` (created); returns their names."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "train.jsonl", "".join(json.dumps({"messages": r["messages"]}, ensure_ascii=False) + "\n"
                                                  for r in rows))
    atomic_write_text(out / "chat_template.jinja", chat_template)
    atomic_write_json(out / "kiln_sft.json", {
        "name": name, "base_model": base_model, "lora": lora_section(config),
        "training": {"epochs": config.epochs, "batch_size": config.batch_size,
                     "gradient_accumulation_steps": config.gradient_accumulation_steps,
                     "learning_rate": config.learning_rate, "weight_decay": config.weight_decay,
                     "max_grad_norm": config.max_grad_norm, "max_seq_len": config.max_seq_len, "seed": config.seed}})
    atomic_write_text(out / "train.py", TRAIN_PY)
    atomic_write_text(out / "requirements.txt", pinned_requirements())
    atomic_write_text(out / "README.md", readme(name, base_model, len(rows)))
    return sorted(p.name for p in out.iterdir())


def write_dpo_bundle(out: Path, *, name: str, pairs: list[dict[str, Any]], chat_template: str, base_model: str,
                     config: DpoBundleConfig) -> list[str]:
    """`pairs`: {"prompt": [messages], "chosen": str, "rejected": str}."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]
    atomic_write_text(out / "train.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(out / "chat_template.jinja", chat_template)
    atomic_write_json(out / "kiln_dpo.json", {
        "name": name, "base_model": base_model, "lora": lora_section(config),
        "training": {"epochs": config.epochs, "batch_size": config.batch_size,
                     "gradient_accumulation_steps": config.gradient_accumulation_steps,
                     "learning_rate": config.learning_rate, "weight_decay": config.weight_decay,
                     "max_grad_norm": config.max_grad_norm, "max_seq_len": config.max_seq_len, "seed": config.seed,
                     "beta": config.beta}})
    atomic_write_text(out / "train.py", TRAIN_DPO_PY)
    atomic_write_text(out / "requirements.txt", pinned_requirements())
    atomic_write_text(out / "README.md", readme(name, base_model, len(rows), kind="dpo"))
    return sorted(p.name for p in out.iterdir())
