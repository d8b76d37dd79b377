"""The C++ BGMV kernel (kernels/lora_bgmv.cpp) against a direct computation, on every ISA path."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model import lora as lora_module
from kiln.model.config import ModelConfig
from kiln.model.lora import LoraBank, LoraStep

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"kernels unavailable: {kernels.load_error()}")


def _isas() -> list[int]:
    return [kernels.ISA_LEVELS[isa] for isa in kernels.cpu_isas()]


def _reference(out, x, a, b, slots):
    ref = out.float().clone()
    for i, s in enumerate(slots.tolist()):
        if s:
            ref[i] += (x[i].float() @ a[s].T) @ b[s]
    return ref


# shapes with tails: K and N not multiples of 16 or 8, and the SmolLM2 projection sizes
@pytest.mark.parametrize("k,n,r", [(576, 1536, 16), (1536, 576, 16), (37, 45, 3), (576, 192, 8), (8, 1, 1)])
@pytest.mark.parametrize("isa", _isas())
def test_kernel_adds_each_rows_own_adapter_delta_in_float32(k, n, r, isa):
    g = torch.Generator().manual_seed(k + n)
    a, b = torch.randn(4, r, k, generator=g), torch.randn(4, r, n, generator=g)
    slots = torch.tensor([1, 0, 3, 1, 2, 0, 3])
    x, out = torch.randn(9, k, generator=g), torch.randn(9, n, generator=g)
    ref = _reference(out, x, a, b, slots)
    kernels.load().lora_bgmv_add(out, x, a, b, slots, isa)
    # float32 sums of up to 1536 terms in another order: relative to the largest value
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("isa", _isas())
def test_kernel_accumulates_in_float32_for_bfloat16_activations(isa):
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3, 8, 64, generator=g), torch.randn(3, 8, 96, generator=g)
    slots = torch.tensor([2, 1, 0])
    x, out = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(3, 96, generator=g).bfloat16()
    expected = _reference(out, x, a, b, slots).bfloat16()
    before = out.clone()
    kernels.load().lora_bgmv_add(out, x, a, b, slots, isa)
    assert torch.equal(out, expected)   # one rounding of base + delta, nothing else
    assert torch.equal(out[2], before[2])   # slot 0: the base model, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_delta_does_not_depend_on_the_rows_sharing_its_adapter(each_isa, dtype):
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(3, 16, 576, generator=g), torch.randn(3, 16, 1536, generator=g)
    x, out = torch.randn(5, 576, generator=g).to(dtype), torch.randn(5, 1536, generator=g).to(dtype)
    slots = torch.tensor([2, 1, 2, 2, 1])
    together = out.clone()
    kernels.load().lora_bgmv_add(together, x, a, b, slots)
    for i in range(5):
        alone = out[i : i + 1].clone()
        kernels.load().lora_bgmv_add(alone, x[i : i + 1], a, b, slots[i : i + 1])
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,r", [(576, 1536, 16), (37, 45, 3)])
@pytest.mark.parametrize("isa", _isas())
def test_a_prefill_chunks_rows_each_get_the_bits_they_get_alone(dtype, k, n, r, isa):
    # 41 rows of slot 1 and 6 of slot 2: blocks of four rows, the rows left over, and a split of the
    # long run across tasks all give a row the result it gets as the only row of its call
    g = torch.Generator().manual_seed(k * n)
    a, b = torch.randn(3, r, k, generator=g).to(dtype), torch.randn(3, r, n, generator=g).to(dtype)
    slots = torch.tensor([0, 2] + [1] * 41 + [2] * 5 + [0])
    x = torch.randn(len(slots), k, generator=g).to(dtype)
    out = torch.randn(len(slots), n, generator=g).to(dtype)
    together = out.clone()
    kernels.load().lora_bgmv_add(together, x, a, b, slots, isa)
    for i in range(len(slots)):
        alone = out[i : i + 1].clone()
        kernels.load().lora_bgmv_add(alone, x[i : i + 1], a, b, slots[i : i + 1], isa)
        assert torch.equal(alone[0], together[i]), i
    ref = _reference(out, x, a.float(), b.float(), slots)
    assert (together.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("k,n", [(576, 1536), (37, 45)])
@pytest.mark.parametrize("isa", _isas())
def test_bfloat16_factors_give_the_bits_of_float32_factors_with_the_same_values(k, n, isa):
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(3, 8, k, generator=g).bfloat16(), torch.randn(3, 8, n, generator=g).bfloat16()
    x = torch.randn(4, k, generator=g).bfloat16()
    out = torch.randn(4, n, generator=g).bfloat16()
    slots = torch.tensor([2, 1, 0, 2])
    want, got = out.clone(), out.clone()
    kernels.load().lora_bgmv_add(want, x, a.float(), b.float(), slots, isa)
    kernels.load().lora_bgmv_add(got, x, a, b, slots, isa)
    assert torch.equal(got, want)


def test_kernel_refuses_factors_of_two_dtypes():
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        kernels.load().lora_bgmv_add(torch.zeros(1, 8), torch.randn(1, 16), torch.randn(2, 4, 16),
                                     torch.randn(2, 4, 8).bfloat16(), torch.tensor([1]))


def test_kernel_leaves_rows_past_the_decode_rows_alone():
    a, b = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    out, x = torch.zeros(5, 8), torch.randn(5, 16)
    kernels.load().lora_bgmv_add(out, x, a, b, torch.tensor([1, 1]))
    assert out[:2].abs().sum() > 0 and torch.equal(out[2:], torch.zeros(3, 8))


def test_kernel_refuses_a_slot_outside_the_bank():
    a, b = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="outside"):
        kernels.load().lora_bgmv_add(torch.zeros(1, 8), torch.randn(1, 16), a, b, torch.tensor([2]))


def _bank_with_two_adapters(hidden: int, inter: int, head_dim: int, layers: int, rank: int,
                            g: torch.Generator) -> LoraBank:
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    bank = LoraBank(cfg, 3, rank, torch.float32, torch.device("cpu"))
    for slot in (1, 2):
        bank.set_slot(slot, {(layer, m): (torch.randn(rank, i, generator=g), torch.randn(o, rank, generator=g), 0.5)
                             for layer in range(layers) for m, (i, o) in bank.shapes.items()})
    return bank


def _kernel_and_torch(monkeypatch, bank: LoraBank, y, x, layer: int, name: str, step: LoraStep):
    with_kernel = bank.apply(y.clone(), x, layer, name, step)
    monkeypatch.setattr(lora_module, "_kernel", lambda x, a: None)
    return with_kernel, bank.apply(y.clone(), x, layer, name, step)


def test_bank_decode_rows_agree_between_kernel_and_torch_fallback(each_isa, monkeypatch):
    g = torch.Generator().manual_seed(3)
    bank = _bank_with_two_adapters(24, 40, 6, layers=2, rank=4, g=g)
    # three decode rows (slots 2, 0, 1), then a 3-token prefill segment on slot 1
    step = LoraStep(torch.tensor([2, 0, 1]), 3, [(3, 3, 1)])
    x = torch.randn(6, 40, generator=g)
    y = torch.randn(6, 24, generator=g)
    with_kernel, with_torch = _kernel_and_torch(monkeypatch, bank, y, x, 1, "down_proj", step)
    assert torch.allclose(with_kernel, with_torch, atol=1e-5)
    assert torch.equal(with_kernel[1], y[1])


def test_a_steps_row_slots_cover_its_decodes_and_prefill_chunks():
    step = LoraStep(torch.tensor([2, 0, 1]), 3, [(3, 2, 1), (7, 3, 2)])
    assert step.row_slots.tolist() == [2, 0, 1, 1, 1, 0, 0, 2, 2, 2]
    assert LoraStep(torch.tensor([1]), 1).row_slots.tolist() == [1]


def test_bank_prefill_chunks_agree_between_kernel_and_torch_fallback(each_isa, monkeypatch):
    g = torch.Generator().manual_seed(5)
    bank = _bank_with_two_adapters(48, 80, 12, layers=1, rank=8, g=g)
    # no decodes; a 37-token chunk on slot 2, a base chunk, a 9-token chunk on slot 1
    step = LoraStep(None, 0, [(0, 37, 2), (45, 9, 1)])
    x = torch.randn(54, 48, generator=g)
    y = torch.randn(54, 80, generator=g)
    with_kernel, with_torch = _kernel_and_torch(monkeypatch, bank, y, x, 0, "gate_proj", step)
    assert torch.allclose(with_kernel, with_torch, atol=1e-4)
    assert torch.equal(with_kernel[37:45], y[37:45])
