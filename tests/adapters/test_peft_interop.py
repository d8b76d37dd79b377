"""PEFT is the reference: adapters it saves load through our store, and adapters we save load in PEFT."""

from __future__ import annotations

import math

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from kiln.adapters.compat import check_compatibility  # noqa: E402
from kiln.adapters.peft_format import config_dict  # noqa: E402
from kiln.adapters.store import AdapterStore  # noqa: E402
from tests.adapters.helpers import MODEL_SPEC, delta, random_factors  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def peft_model(**lora_kwargs):
    cfg = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **lora_kwargs)
    return peft.get_peft_model(tiny_llama(), cfg).eval()


def lora_layer(model, layer: int, module: str):
    return getattr(getattr(model.base_model.model.model.layers[layer], PARENT[module]), module)


def peft_delta(model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    mod = lora_layer(model, layer, module)
    with torch.no_grad():
        return mod(x) - mod.base_layer(x)


@pytest.fixture
def store(tmp_path):
    return AdapterStore(tmp_path / "adapters")


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_saved_adapter_loads_with_peft_deltas(store, use_rslora):
    model = peft_model(r=4, lora_alpha=16, target_modules=MODULES, use_rslora=use_rslora)
    model.save_pretrained(store.root / "from-peft")
    modules = store.load_lora_tensors("from-peft")
    assert set(modules) == {(layer, m) for layer in range(2) for m in MODULES}
    expected_scale = 16 / math.sqrt(4) if use_rslora else 16 / 4
    x = torch.randn(3, 24)
    for (layer, module), (a, b, scale) in modules.items():
        assert scale == pytest.approx(expected_scale)
        xin = x[:, : a.shape[1]]
        torch.testing.assert_close(delta(a, b, scale, xin), peft_delta(model, layer, module, xin))


def test_peft_rank_and_alpha_patterns_give_per_module_scales(store):
    model = peft_model(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                       rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3})
    model.save_pretrained(store.root / "patterned")
    modules = store.load_lora_tensors("patterned")
    x = torch.randn(2, 16)
    for (layer, module), (a, b, scale) in modules.items():
        assert scale == pytest.approx(3 / 4 if module == "q_proj" else 8 / 2)
        torch.testing.assert_close(delta(a, b, scale, x), peft_delta(model, layer, module, x))


def test_peft_saved_adapter_is_compatible_with_the_same_shaped_model(store):
    peft_model(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]).save_pretrained(store.root / "p")
    report = check_compatibility(store.load_adapter("p"), MODEL_SPEC)
    assert report.compatible
    assert report.matched == {"down_proj": [0, 1], "q_proj": [0, 1]}
    assert report.missing_targets == []


def test_adapter_we_save_loads_in_peft_with_identical_weights(store):
    factors = random_factors(4, modules=MODULES, seed=3)
    store.save_adapter("ours", factors, config_dict(4, 12, MODULES))
    model = peft.PeftModel.from_pretrained(tiny_llama(), store.root / "ours").eval()
    x = torch.randn(2, 24)
    for (layer, module), (a, b) in factors.items():
        mod = lora_layer(model, layer, module)
        torch.testing.assert_close(mod.lora_A["default"].weight, a)
        torch.testing.assert_close(mod.lora_B["default"].weight, b)
        assert mod.scaling["default"] == pytest.approx(12 / 4)
        xin = x[:, : a.shape[1]]
        torch.testing.assert_close(peft_delta(model, layer, module, xin), delta(a, b, 3.0, xin))


def test_rslora_adapter_we_save_keeps_its_scale_in_peft(store):
    factors = random_factors(4, modules=["q_proj"], seed=4)
    store.save_adapter("rs", factors, config_dict(4, 8, ["q_proj"], use_rslora=True))
    model = peft.PeftModel.from_pretrained(tiny_llama(), store.root / "rs")
    assert lora_layer(model, 0, "q_proj").scaling["default"] == pytest.approx(8 / 2)
    assert store.load_lora_tensors("rs")[(0, "q_proj")].scale == pytest.approx(8 / 2)
