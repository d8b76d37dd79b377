"""Trainable LoRA over a frozen base: only the adapter learns, and it saves as a loadable PEFT adapter."""

from __future__ import annotations

import math

import torch

from kiln.adapters.peft_format import config_dict
from kiln.adapters.store import AdapterStore
from kiln.model.loader import load_model
from kiln.train.masks import mask_conversation
from kiln.train.sft import SftWork
from kiln.train.trainable_lora import TrainableLora, freeze_base

CONV = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]


def sft_loss(model, lora, tokenizer, template):
    seq = mask_conversation(template, tokenizer, CONV)
    return SftWork([seq]).loss(model, lora, [seq], seq.num_trained, {})[0]


def test_base_parameters_get_no_gradient_and_adapter_parameters_do(tiny_model, tokenizer, chatml):
    freeze_base(tiny_model)
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0)
    opt = torch.optim.SGD(lora.parameters(), lr=0.1)
    for _ in range(2):  # B starts at zero, so A's gradient appears only after the first update
        opt.zero_grad()
        sft_loss(tiny_model, lora, tokenizer, chatml).backward()
        opt.step()
    assert all(p.grad is None and not p.requires_grad for p in tiny_model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora.parameters())


def test_training_never_changes_the_base_weights(tiny_model, tokenizer, chatml):
    freeze_base(tiny_model)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0)
    opt = torch.optim.AdamW(lora.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        sft_loss(tiny_model, lora, tokenizer, chatml).backward()
        opt.step()
    after = tiny_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_fresh_adapter_is_exactly_the_base_model(tiny_model):
    lora = TrainableLora(tiny_model.config, 8, 16, seed=1)
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.no_grad():
        assert torch.equal(tiny_model.forward_dense(ids, lora=lora), tiny_model.forward_dense(ids))


def test_a_is_kaiming_uniform_like_peft_and_b_is_zero(tiny_model):
    lora = TrainableLora(tiny_model.config, 8, 16, seed=3)
    a = lora.a["0_q_proj"]
    assert a.abs().max() <= 1 / math.sqrt(a.shape[1]) and a.std() > 0
    assert all(torch.count_nonzero(b) == 0 for b in lora.b.values())
    same_seed = TrainableLora(tiny_model.config, 8, 16, seed=3)
    assert torch.equal(same_seed.a["1_down_proj"], lora.a["1_down_proj"])


def test_a_bfloat16_base_trains_float32_factors(tiny_dir, tokenizer, chatml):
    model, _ = load_model(str(tiny_dir), dtype="bfloat16")
    freeze_base(model)
    lora = TrainableLora(model.config, 4, 8, seed=0)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    assert lora.delta(x, 0, "q_proj").dtype == torch.bfloat16
    sft_loss(model, lora, tokenizer, chatml).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in lora.parameters())


def test_saved_factors_load_back_into_the_same_model_outputs(tiny_model, tmp_path):
    lora = TrainableLora(tiny_model.config, 4, 8, seed=0, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():
        for b in lora.b.values():
            b.normal_(0, 0.5)
    store = AdapterStore(tmp_path)
    store.save_adapter("taught", lora.factors(), config_dict(4, 8, ["q_proj", "down_proj"]))
    again = TrainableLora(tiny_model.config, 4, 8, target_modules=["q_proj", "down_proj"])
    again.load_factors(store.load_lora_tensors("taught"))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(tiny_model.forward_dense(ids, lora=again), tiny_model.forward_dense(ids, lora=lora))
        assert not torch.equal(tiny_model.forward_dense(ids, lora=lora), tiny_model.forward_dense(ids))


def test_untargeted_modules_add_no_delta(tiny_model):
    lora = TrainableLora(tiny_model.config, 4, 8, target_modules=["v_proj"])
    x = torch.randn(2, tiny_model.config.hidden_size)
    assert lora.delta(x, 0, "q_proj") is None and lora.delta(x, 0, "v_proj") is not None
