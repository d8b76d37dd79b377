"""The adapter directory: atomic saves, listing, manifests, content identity, validation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kiln.adapters import identity
from kiln.adapters.peft_format import config_dict
from kiln.adapters.store import AdapterStore
from kiln.errors import KilnError
from tests.adapters.helpers import random_factors, save_random


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "adapters")


def test_saved_adapter_has_peft_files_and_manifest(store):
    save_random(store, "a", r=2, alpha=4)
    files = sorted(p.name for p in (store.root / "a").iterdir())
    assert files == ["adapter_config.json", "adapter_manifest.json", "adapter_model.safetensors"]
    cfg = json.loads((store.root / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 4 and cfg["peft_type"] == "LORA"


def test_saved_tensor_keys_follow_peft_naming(store):
    save_random(store, "a", modules=["q_proj", "down_proj"])
    keys = set(store.read_peft_tensors("a"))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 8


def test_load_lora_tensors_returns_a_b_and_alpha_over_r(store):
    factors = save_random(store, "a", r=4, alpha=6)
    modules = store.load_lora_tensors("a")
    assert set(modules) == set(factors)
    a, b, scale = modules[(1, "v_proj")]
    torch.testing.assert_close(a, factors[(1, "v_proj")][0])
    torch.testing.assert_close(b, factors[(1, "v_proj")][1])
    assert scale == 6 / 4


def test_manifest_hashes_the_file_bytes(store):
    save_random(store, "a")
    manifest = json.loads((store.root / "a" / "adapter_manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["manifest_type"] == "kiln_adapter_manifest"
    assert manifest["adapter_name"] == "a"
    assert manifest["safetensors_hash"] == identity.file_hash(store.root / "a" / "adapter_model.safetensors")
    assert manifest["config_hash"] == identity.file_hash(store.root / "a" / "adapter_config.json")
    assert "receipt_hash" not in manifest


def test_receipt_is_written_and_hashed_into_the_manifest(store):
    store.save_adapter("a", random_factors(2), config_dict(2, 4), receipt={"status": "succeeded"})
    manifest = json.loads((store.root / "a" / "adapter_manifest.json").read_text())
    assert manifest["files"]["train_receipt"] == "train_receipt.json"
    assert manifest["receipt_hash"] == identity.file_hash(store.root / "a" / "train_receipt.json")


def test_listing_reports_files_size_and_content_hash(store):
    save_random(store, "b")
    save_random(store, "a")
    infos = store.list()
    assert [i.name for i in infos] == ["a", "b"]
    info = infos[0]
    assert info.has_config and info.has_weights
    assert info.files == ["adapter_config.json", "adapter_manifest.json", "adapter_model.safetensors"]
    assert info.size_bytes == sum(p.stat().st_size for p in (store.root / "a").iterdir())
    assert info.content_sha256.startswith("sha256:") and len(info.content_sha256) == 71
    assert info.modified_at.endswith("Z")


def test_listing_skips_hidden_entries(store):
    save_random(store, "a")
    (store.root / ".composed").mkdir()
    (store.root / ".tmp-123").mkdir()
    assert store.names() == ["a"]


def test_listing_surfaces_a_malformed_manifest(store):
    save_random(store, "a")
    (store.root / "a" / "adapter_manifest.json").write_text("{not json")
    info = store.info("a")
    assert info.manifest is None
    assert "not valid JSON" in info.adapter_manifest_error


def test_incomplete_adapter_is_listed_without_hash(store):
    (store.root / "half").mkdir(parents=True)
    (store.root / "half" / "adapter_config.json").write_text(json.dumps(config_dict(2, 4)))
    info = store.info("half")
    assert info.has_config and not info.has_weights and info.content_sha256 is None


def test_content_hash_is_identical_for_identical_bytes(store):
    save_random(store, "a", seed=1)
    save_random(store, "b", seed=1)
    save_random(store, "c", seed=2)
    assert store.content_hash("a") == store.content_hash("b") != store.content_hash("c")


def test_content_hash_is_cached_until_the_files_change(store, monkeypatch):
    save_random(store, "a", seed=1)
    first = store.content_hash("a")
    calls = []
    real = identity.compute_content_hash
    monkeypatch.setattr("kiln.adapters.store.compute_content_hash", lambda p: calls.append(p) or real(p))
    assert store.content_hash("a") == first and calls == []
    cfg_path = store.root / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["lora_alpha"] = 99
    cfg_path.write_text(json.dumps(cfg))
    assert store.content_hash("a") != first and len(calls) == 1


def test_save_refuses_an_existing_name_unless_overwrite(store):
    save_random(store, "a", seed=1)
    with pytest.raises(KilnError) as e:
        save_random(store, "a", seed=2)
    assert e.value.status == 409 and e.value.code == "adapter_already_exists"
    store.save_adapter("a", random_factors(4, seed=2), config_dict(4, 8), overwrite=True)
    torch.testing.assert_close(store.load_lora_tensors("a")[(0, "q_proj")].a, random_factors(4, seed=2)[(0, "q_proj")][0])


def test_failed_save_leaves_nothing_visible(store, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("kiln.adapters.store.save_file", boom)
    with pytest.raises(OSError):
        save_random(store, "a")
    assert store.names() == [] and os.listdir(store.root) == []


def test_save_rejects_a_rank_that_disagrees_with_the_config(store):
    with pytest.raises(KilnError) as e:
        store.save_adapter("a", random_factors(4), config_dict(2, 4))
    assert e.value.code == "adapter_layout_invalid"


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "a..b", ".hidden", "/abs"])
def test_names_must_be_one_safe_segment(store, name):
    with pytest.raises(KilnError) as e:
        store.require(name)
    assert e.value.status == 400 and e.value.code == "invalid_adapter_name"


def test_missing_adapter_is_404(store):
    with pytest.raises(KilnError) as e:
        store.load_lora_tensors("nope")
    assert e.value.status == 404 and e.value.code == "adapter_not_found"


def test_delete_removes_the_folder(store):
    save_random(store, "a")
    store.delete("a")
    assert not (store.root / "a").exists() and os.listdir(store.root) == []


@pytest.mark.parametrize("field,value", [
    ("peft_type", "IA3"),
    ("modules_to_save", ["lm_head"]),
    ("use_dora", True),
    ("bias", "all"),
    ("fan_in_fan_out", True),
])
def test_unservable_configs_are_rejected_with_the_field(store, field, value):
    save_random(store, "a")
    path = store.root / "a" / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {field: value}))
    with pytest.raises(KilnError) as e:
        store.load_lora_tensors("a")
    assert e.value.status == 400 and e.value.code == "adapter_layout_invalid"
    assert e.value.param.endswith(field)


def test_unknown_tensor_keys_are_a_layout_error(store):
    from safetensors.torch import save_file

    save_random(store, "a")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, store.root / "a" / "adapter_model.safetensors")
    with pytest.raises(KilnError) as e:
        store.load_lora_tensors("a")
    assert e.value.code == "adapter_layout_invalid" and "lm_head.weight" in e.value.message


def test_save_accepts_a_lora_config_object(store):
    from kiln.adapters.peft_format import LoraConfig

    store.save_adapter("a", random_factors(2, modules=["q_proj"]), LoraConfig(r=2, lora_alpha=6, target_modules=("q_proj",)))
    cfg = store.read_config("a")
    assert (cfg.r, cfg.lora_alpha, cfg.target_modules) == (2, 6, ("q_proj",))
