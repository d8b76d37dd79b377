"""Batched multi-adapter LoRA: our logits with an adapter equal peft + transformers, alone and mixed."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kiln.adapters.compose import compose_modules
from kiln.adapters.store import AdapterStore
from kiln.model import kernels
from kiln.model import lora as lora_module
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.lora import MODULES, LoraBank, build_lora_step

from .conftest import TinyModel

BLOCK = 4


def _peft_adapter(tiny: TinyModel, tmp_path, name: str, modules: list[str], seed: int, r: int = 4):
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(tiny.hf), LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)  # peft starts B at zero; make the delta visible
    peft_model.save_pretrained(tmp_path / name)
    return peft_model.eval()


def _forward(model, items, slots):
    """items: (table, ids, computed) -> float32 logits of the fed tokens per item."""
    meta, positions = build_attention_metadata(
        [(t, c, len(ids) - c) for t, ids, c in items], BLOCK, "cpu")
    flat = [tok for _, ids, c in items for tok in ids[c:]]
    lora = build_lora_step(slots, [len(ids) - c for _, ids, c in items], meta.num_decode_tokens,
                           torch.device("cpu"))
    cache = model._test_cache
    hidden = model(torch.tensor(flat), torch.tensor(positions), meta, cache, lora)
    logits = model.compute_logits(hidden)
    out, start = [], 0
    for _, ids, c in items:
        out.append(logits[start : start + len(ids) - c])
        start += len(ids) - c
    return out


@pytest.mark.parametrize("modules", [["q_proj", "v_proj"], ["k_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_adapter_logits_match_peft_per_module_type(tiny_llama: TinyModel, tmp_path, modules):
    peft_model = _peft_adapter(tiny_llama, tmp_path, "a", modules, seed=1)
    store = AdapterStore(tmp_path)
    model = tiny_llama.ours
    model.lora_bank = LoraBank(model.config, 2, 4, torch.float32, torch.device("cpu"))
    model.lora_bank.set_slot(1, store.load_lora_tensors("a"))
    model._test_cache = KVCache(model.config, 16, BLOCK, torch.float32, torch.device("cpu"))
    ids = [3, 17, 42, 8, 9, 55, 21]
    ours = _forward(model, [(list(range(2)), ids, 0)], [1])[0]
    with torch.no_grad():
        ref = peft_model(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # slot 0 is still the plain base model
    base = _forward(model, [(list(range(2, 4)), ids, 0)], [0])[0]
    with torch.no_grad():
        base_ref = tiny_llama.hf(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(base, base_ref, atol=1e-4)
    model.lora_bank = None


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decode rows through the C++ BGMV kernel, or through torch's gather + bmm fallback."""
    if request.param == "kernel":
        if kernels.load() is None:
            pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    else:
        monkeypatch.setattr(lora_module, "_kernel", lambda x, a: None)
    return request.param


def test_mixed_batch_gives_each_request_its_own_adapter(tiny_llama: TinyModel, tmp_path, decode_path):
    _peft_adapter(tiny_llama, tmp_path, "x", list(MODULES), seed=2)
    _peft_adapter(tiny_llama, tmp_path, "y", ["q_proj", "down_proj"], seed=3, r=2)
    store = AdapterStore(tmp_path)
    x, y = store.load_lora_tensors("x"), store.load_lora_tensors("y")
    xy = compose_modules([(x, 1.0), (y, 0.5)])
    model = tiny_llama.ours
    bank = LoraBank(model.config, 4, 6, torch.float32, torch.device("cpu"))
    bank.set_slot(1, x)
    bank.set_slot(2, y)
    bank.set_slot(3, xy)
    model.lora_bank = bank
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34]]
    slots = [0, 1, 2, 3]

    def run(batch: list[int]) -> dict[int, torch.Tensor]:
        """Prefill the chosen requests (each alone), then one batched decode step."""
        model._test_cache = KVCache(model.config, 32, BLOCK, torch.float32, torch.device("cpu"))
        tables = {i: list(range(i * 4, i * 4 + 4)) for i in batch}
        for i in batch:
            _forward(model, [(tables[i], prompts[i], 0)], [slots[i]])
        items = [(tables[i], prompts[i] + [40 + i], len(prompts[i])) for i in batch]
        logits = _forward(model, items, [slots[i] for i in batch])
        return {i: lg[-1] for i, lg in zip(batch, logits, strict=True)}

    together = run([0, 1, 2, 3])
    for i in range(4):
        alone = run([i])[i]
        assert torch.allclose(together[i], alone, atol=1e-5)
    # the adapters really differ from the base and from each other
    assert not torch.allclose(together[0], together[1], atol=1e-3)
    assert not torch.allclose(together[1], together[3], atol=1e-3)
    model.lora_bank = None


def test_bank_growth_keeps_factors(tiny_llama: TinyModel, tmp_path):
    _peft_adapter(tiny_llama, tmp_path, "g", ["q_proj"], seed=4)
    mods = AdapterStore(tmp_path).load_lora_tensors("g")
    bank = LoraBank(tiny_llama.ours.config, 2, 4, torch.float32, torch.device("cpu"))
    bank.set_slot(1, mods)
    big = bank.grown(5, 8)
    assert big.num_slots == 5 and big.rank == 8
    assert torch.equal(big.a["q_proj"][:, 1, :4], bank.a["q_proj"][:, 1])
    assert big.used["q_proj"] == {1}


def test_dense_routing_scores_a_prompt_as_the_merged_weights_would(tiny_llama: TinyModel, tmp_path):
    """Prompt scoring under an adapter (forward_dense with DenseRouting over the serving bank) gives the
    logits of the base weights with the adapter's deltas merged in."""
    from kiln.engine.scoring import compute_prompt_scores
    from kiln.model.lora import DenseRouting

    _peft_adapter(tiny_llama, tmp_path, "a", ["q_proj", "v_proj", "down_proj"], seed=4)
    store = AdapterStore(tmp_path)
    model = copy.deepcopy(tiny_llama.ours)
    model.lora_bank = LoraBank(model.config, 3, 4, torch.float32, torch.device("cpu"))
    modules = store.load_lora_tensors("a")
    model.lora_bank.set_slot(2, modules)
    ids = [3, 17, 42, 8, 9, 55, 21]
    routed = DenseRouting(model.lora_bank, build_lora_step([2], [len(ids)], 0, torch.device("cpu")))
    with torch.inference_mode():
        ours = model.forward_dense(torch.tensor([ids]), lora=routed)[0]
        base = model.forward_dense(torch.tensor([ids]))[0]
    merged = copy.deepcopy(tiny_llama.ours)
    with torch.no_grad():
        for (layer, name), (a, b, scale) in modules.items():
            parent = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            merged.get_submodule(f"model.layers.{layer}.{parent}.{name}").weight.add_(scale * (b.float() @ a.float()))
        want = merged.forward_dense(torch.tensor([ids]))[0]
    assert (ours - base).abs().max() > 0.05
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    scored = compute_prompt_scores(model, ids, 2, routed)
    assert scored.observed_logprobs == pytest.approx(
        torch.log_softmax(want[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist(), abs=1e-4)
