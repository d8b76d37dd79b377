"""`kiln adapters export`: a PEFT folder naming the real base model, and a llama.cpp LoRA GGUF whose
tensors (q/k permuted for llama, every module's scale folded into B) give llama.cpp Kiln's deltas."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from gguf import GGUFReader

import kiln.api.app as app_module
from kiln.adapters.export import (
    EMBEDDED_BASE_HF_ID,
    BaseModelRef,
    base_model_reference,
    gguf_lora_tensors,
    permute_qk_rows,
    serve_commands,
)
from kiln.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from kiln.adapters.store import AdapterStore
from kiln.commands import adapters as cmd
from kiln.commands.client import ServerClient
from kiln.config import DataSettings, ModelSettings, Settings
from kiln.model.config import ModelConfig
from kiln.model.gguf_loader import unpermute_qk
from kiln.server import build_state
from kiln.testing.stand_in import StandInEngine
from tests.adapters.helpers import TINY, save_random


def _config(arch: str = "llama") -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=64, hidden_size=TINY.hidden_size,
                       intermediate_size=TINY.intermediate_size, num_hidden_layers=2,
                       num_attention_heads=TINY.num_attention_heads, num_key_value_heads=TINY.num_key_value_heads,
                       head_dim=TINY.head_dim, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
                       bos_token_id=None, eos_token_ids=[0])


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "adapters")


def test_permute_is_the_inverse_of_the_loaders_unpermute():
    w = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8 * 4, 3)
    assert torch.equal(unpermute_qk(permute_qk_rows(w, 8), 8), w)
    assert not torch.equal(permute_qk_rows(w, 8), w)


def test_gguf_tensors_fold_each_modules_scale_and_permute_q_and_k(store):
    save_random(store, "a", r=2, alpha=6, alpha_pattern={"v_proj": 1.0, "k_proj": 2.0})
    modules = store.load_adapter("a").modules
    tensors = gguf_lora_tensors(modules, _config("llama"))
    heads = {"q_proj": TINY.num_attention_heads, "k_proj": TINY.num_key_value_heads}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "down_proj": "ffn_down"}
    for (layer, module), lm in modules.items():
        if module not in names:
            continue
        a = tensors[f"blk.{layer}.{names[module]}.weight.lora_a"]
        b = tensors[f"blk.{layer}.{names[module]}.weight.lora_b"]
        if module in heads:
            b = unpermute_qk(b, heads[module])
        assert torch.allclose(b @ a, lm.scale * (lm.b @ lm.a), atol=1e-5)
        assert a.dtype == torch.float32 and b.shape[1] == a.shape[0]
    # the scales differ per module (alpha 2 on k, 1 on v): folding is what keeps them
    assert len({round(lm.scale, 6) for lm in modules.values()}) == 3


def test_qwen_models_keep_q_and_k_rows_in_place(store):
    save_random(store, "a", r=2, alpha=4, modules=["q_proj"])
    lm = store.load_adapter("a").modules[(0, "q_proj")]
    b = gguf_lora_tensors({(0, "q_proj"): lm}, _config("qwen2"))["blk.0.attn_q.weight.lora_b"]
    assert torch.allclose(b, lm.scale * lm.b)


def test_base_model_reference_names_the_hf_id_or_the_path(tmp_path):
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3-0.6B"}))
    assert base_model_reference(str(hf)).hf == "Qwen/Qwen3-0.6B"
    (hf / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))
    assert base_model_reference(str(hf)) == BaseModelRef(str(hf.resolve()), None)
    ref = base_model_reference(str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"), embedded=True)
    assert ref.hf == EMBEDDED_BASE_HF_ID and ref.gguf.endswith(".gguf")


def test_serve_commands_are_vllm_and_llama_server_lines(tmp_path):
    ref = BaseModelRef("org/base", "/m/base.gguf")
    lines = serve_commands("ad", ref, peft_dir=tmp_path / "ad", gguf_file=tmp_path / "ad.gguf", max_rank=12)
    assert lines[0] == f"vllm serve org/base --enable-lora --max-lora-rank 16 --lora-modules ad={tmp_path / 'ad'}"
    assert lines[1] == f"llama-server -m /m/base.gguf --lora {tmp_path / 'ad.gguf'}"


# ---- the CLI over the real route (in process) --------------------------------------------------------


@pytest.fixture
def cli(tmp_path, monkeypatch, store):
    model = tmp_path / "base-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"_name_or_path": "org/tiny-base"}))
    settings = Settings(data=DataSettings(data_dir=str(tmp_path / "data")), model=ModelSettings(path=str(model)))
    state = build_state(settings, adapter_store=store)
    state.engine = StandInEngine(info=SimpleNamespace(config=_config("llama")))
    app = app_module.create_app(settings, state, routers=["kiln.api.routers.adapters",
                                                          "kiln.api.routers.adapter_export"])

    def fake_init(self, url, timeout=600.0):
        self.url = url
        self.http = TestClient(app, base_url=url)

    monkeypatch.setattr(ServerClient, "__init__", fake_init)
    save_random(store, "ad", r=4, alpha=8, base_model_name_or_path="tiny")

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser(prog="kiln")
        cmd.register(parser.add_subparsers(dest="command"))
        args = parser.parse_args(list(argv))
        return args.func(args)

    return run


def test_export_peft_names_the_real_base_model_and_prints_the_vllm_line(cli, tmp_path, capsys, store):
    out = tmp_path / "out"
    assert cli("adapters", "export", "ad", str(out)) == 0
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == "org/tiny-base"
    assert (out / WEIGHTS_FILE).read_bytes() == (store.path("ad") / WEIGHTS_FILE).read_bytes()
    printed = capsys.readouterr().out
    assert f"vllm serve org/tiny-base --enable-lora --max-lora-rank 8 --lora-modules ad={out.resolve()}" in printed


def test_export_gguf_writes_a_lora_adapter_llama_cpp_reads(cli, tmp_path, capsys, store):
    out = tmp_path / "out"
    assert cli("adapters", "export", "ad", str(out), "--format", "gguf") == 0
    path = out / "ad.gguf"
    reader = GGUFReader(str(path))

    def field(key):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]

    assert field("general.type") == "adapter" and field("adapter.type") == "lora"
    assert field("general.architecture") == "llama" and field("adapter.lora.alpha") == 0.0
    by_name = {t.name: t for t in reader.tensors}
    lm = store.load_adapter("ad").modules[(1, "v_proj")]
    a = by_name["blk.1.attn_v.weight.lora_a"]
    assert [int(x) for x in a.shape] == [lm.a.shape[1], lm.a.shape[0]]  # GGUF lists ne: [in, r]
    b = torch.from_numpy(np.array(by_name["blk.1.attn_v.weight.lora_b"].data))
    assert torch.allclose(b, lm.scale * lm.b, atol=1e-6)
    assert f"--lora {path.resolve()}" in capsys.readouterr().out


def test_export_of_an_unknown_adapter_is_a_404(cli, tmp_path, capsys):
    assert cli("adapters", "export", "nope", str(tmp_path / "o")) == 1
    assert "not found" in capsys.readouterr().err.lower()
