"""Where the CPU has no bf16 dot products, torch's own matmuls never run in (emulated) bfloat16: the
dense path (training forward and backward, scoring, the LM head, LoRA) computes in float32 over the
bfloat16 weights, while serving keeps the bfloat16 kernels."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.model import kernels, precision
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import load_model
from kiln.model.quant import kernels_available
from kiln.train.forward import final_hidden, selected_logprobs
from kiln.train.trainable_lora import TrainableLora, freeze_base

AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear,
           aten._scaled_dot_product_flash_attention_for_cpu}


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of every tensor that reaches a matmul (forward and backward) inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


@pytest.fixture
def avx2_cpu(monkeypatch: pytest.MonkeyPatch):
    """An AVX2-only CPU (the Zen 2/3 case), whatever machine runs the test."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX2_ONLY)
    with kernels.using_isa("avx2"):
        yield


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch):
    """A Zen 4 with AVX512-BF16 running Kiln and torch at AVX-512. On a CPU without AVX-512 the built
    library cannot switch to it (its cpuid refuses), so only the selection the precision rules read
    says avx512 there; what these tests run is torch's dense path, not the kernels."""
    real_avx512 = "avx512" in kernels.cpu_isas()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(precision, "_torch_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if real_avx512:
        with kernels.using_isa("avx512"):
            yield
    else:
        monkeypatch.setattr(kernels, "_selected", "avx512")
        monkeypatch.setattr(kernels, "_forced", False)
        yield


@pytest.fixture
def bf16_model(tiny):
    model, _ = load_model(str(tiny.path), dtype="bfloat16")
    freeze_base(model)
    return model


def test_an_avx2_cpu_has_no_native_bf16_and_computes_bfloat16_weights_in_float32(avx2_cpu) -> None:
    assert not precision.native_bf16()
    assert precision.compute_dtype(torch.bfloat16) == torch.float32
    assert precision.compute_dtype(torch.float32) == torch.float32


def test_a_cpu_with_avx512_bf16_keeps_bfloat16(bf16_cpu) -> None:
    assert precision.native_bf16()
    assert precision.compute_dtype(torch.bfloat16) == torch.bfloat16


def test_forcing_kiln_to_avx2_stands_for_an_avx2_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "cpu_flags", lambda: ZEN4)
    monkeypatch.setattr(precision, "_torch_capability", lambda: "AVX512")
    with kernels.using_isa("avx2"):
        assert not precision.native_bf16()


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE"])
def test_onednn_held_below_bf16_means_no_native_bf16(bf16_cpu, monkeypatch: pytest.MonkeyPatch, cap: str) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert not precision.native_bf16()


def test_torch_forced_to_avx2_means_no_native_bf16(bf16_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_torch_capability", lambda: "AVX2")
    assert not precision.native_bf16()


def test_no_bfloat16_matmul_runs_in_a_training_step_on_an_avx2_cpu(avx2_cpu, bf16_model) -> None:
    lora = TrainableLora(bf16_model.config, 4, 8, seed=0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with MatmulDtypes() as seen:
        logp = selected_logprobs(bf16_model, ids, attention, attention[:, 1:].float(), lora)
        logp.sum().backward()
    assert seen.dtypes == {torch.float32}
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora.parameters())


def test_no_bfloat16_matmul_runs_in_scoring_on_an_avx2_cpu(avx2_cpu, bf16_model) -> None:
    with MatmulDtypes() as seen, torch.inference_mode():
        logits = bf16_model.forward_dense(torch.tensor([[3, 4, 5, 6, 7]]))
    assert seen.dtypes == {torch.float32} and logits.dtype == torch.float32


def test_checkpointed_layers_also_recompute_in_float32(avx2_cpu, bf16_model) -> None:
    lora = TrainableLora(bf16_model.config, 4, 8, seed=0)
    with MatmulDtypes() as seen:
        final_hidden(bf16_model, torch.tensor([[5, 6, 7, 8]]), None, lora, checkpoint_layers=True).sum().backward()
    assert seen.dtypes == {torch.float32}


def test_the_dense_path_stays_bfloat16_where_the_cpu_has_bf16_dot_products(bf16_cpu, bf16_model) -> None:
    assert bf16_model.dense_dtype == torch.bfloat16
    with MatmulDtypes() as seen, torch.inference_mode():
        bf16_model.forward_dense(torch.tensor([[3, 4, 5, 6, 7]]))
    assert torch.bfloat16 in seen.dtypes


def test_float32_compute_matches_a_float32_copy_of_the_same_weights(avx2_cpu, bf16_model, tiny) -> None:
    """Widening each weight where it is used is the float32 model with the bfloat16-rounded weights."""
    f32, _ = load_model(str(tiny.path), dtype="float32")
    f32.load_state_dict_hf({k: v.float() for k, v in bf16_model.state_dict().items()})
    f32.rotary.cos, f32.rotary.sin_signed = bf16_model.rotary.cos.float(), bf16_model.rotary.sin_signed.float()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(bf16_model.forward_dense(ids), f32.forward_dense(ids), atol=1e-5, rtol=1e-5)


def test_mixed_linear_keeps_no_float32_copy_of_the_weight_for_backward(avx2_cpu) -> None:
    weight = torch.randn(24, 16).bfloat16()
    x = torch.randn(3, 16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = precision.mixed_linear(x, weight, None)
    assert y.dtype == torch.float32 and all(t.dtype == torch.bfloat16 for t in saved)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight.float())


def test_with_bf16_dot_products_mixed_linear_multiplies_in_bfloat16_and_keeps_float32_around_it(bf16_cpu) -> None:
    weight = torch.randn(24, 16).bfloat16()
    bias = torch.randn(24).bfloat16()
    x = torch.randn(3, 16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with MatmulDtypes() as seen, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = precision.mixed_linear(x, weight, bias)
    assert seen.dtypes == {torch.bfloat16} and all(t.dtype == torch.bfloat16 for t in saved)
    want = torch.nn.functional.linear(x.detach().bfloat16(), weight).float() + bias.float()
    assert y.dtype == torch.float32 and torch.equal(y.detach(), want)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, (grad.bfloat16() @ weight).float())
    with torch.no_grad():   # reference log-probs see the training forward's values
        assert torch.equal(precision.mixed_linear(x, weight, bias), want)


def test_training_computes_in_float32_on_every_cpu(bf16_cpu) -> None:
    assert precision.training_dtype(torch.bfloat16) == torch.float32
    assert precision.training_dtype(torch.float32) == torch.float32


def test_serving_keeps_its_bfloat16_kernels_on_an_avx2_cpu(avx2_cpu, bf16_model) -> None:
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    cache = KVCache(bf16_model.config, num_blocks=8, block_size=4, dtype=torch.bfloat16, device="cpu")
    meta, positions = build_attention_metadata([([0, 1], 0, 6)], 4, "cpu")
    with MatmulDtypes() as seen:
        hidden = bf16_model(torch.tensor([3, 4, 5, 6, 7, 8]), torch.tensor(positions), meta, cache)
        bf16_model.compute_logits(hidden, packed_ok=True)
    assert hidden.dtype == torch.bfloat16
    assert torch.bfloat16 not in seen.dtypes   # the projections ran in the C++ dense kernel


def block_weights() -> list:
    from kiln.model import kquant
    from kiln.testing.kquant_blocks import random_blocks
    return [kquant.pack_from_gguf(kind, random_blocks(kind, n, k, seed=n), (n, k))
            for kind, n, k in (("q4_k", 40, 512), ("q6_k", 24, 256), ("q5_k", 72, 512))]


def chained_block_products(packed: list, dense: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every weight's forward first, then the backward through all of them (so each backward comes after
    other weights have been dequantized since its forward): outputs and input gradients."""
    xs = [torch.randn(5, p.in_features, generator=torch.Generator().manual_seed(i), requires_grad=True)
          for i, p in enumerate(packed)]
    biases = [torch.randn(p.out_features, generator=torch.Generator().manual_seed(9)).bfloat16() for p in packed]
    ys = [precision.mixed_linear(x, p.dequantize(torch.bfloat16), b) if dense
          else precision.block_linear(x, p, b, torch.bfloat16) for x, p, b in zip(xs, packed, biases, strict=True)]
    sum(y.square().sum() for y in ys).backward()
    return [y.detach() for y in ys], [x.grad for x in xs]


def assert_dense_gradients(got: list[torch.Tensor], want: list[torch.Tensor], cpu: str) -> None:
    """On bf16 dot products the dense copy's bits; in float32 (an AVX2 CPU) the kernel multiplies from
    the blocks and sums in another order than sgemm: the same up to float32 rounding."""
    for a, b in zip(got, want, strict=True):
        if cpu == "bf16_cpu" or not kernels_available():
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=float(b.abs().max()) * 2.0 ** -20)


@pytest.mark.parametrize("cpu", ["avx2_cpu", "bf16_cpu"])
def test_block_linear_gives_the_dense_weights_values_and_gradients(cpu: str, request) -> None:
    request.getfixturevalue(cpu)
    packed = block_weights()
    got_y, got_grad = chained_block_products(packed, dense=False)
    want_y, want_grad = chained_block_products(packed, dense=True)
    assert all(torch.equal(a, b) for a, b in zip(got_y, want_y, strict=True))
    assert_dense_gradients(got_grad, want_grad, cpu)
    with torch.no_grad():   # scoring: the same values without autograd
        x = torch.randn(2, 512)
        assert torch.equal(precision.block_linear(x, packed[0], None, torch.bfloat16),
                           precision.mixed_linear(x, packed[0].dequantize(torch.bfloat16), None))


@pytest.mark.parametrize("cpu", ["avx2_cpu", "bf16_cpu"])
def test_a_weight_over_the_scratch_bound_goes_in_panels_with_the_dense_weights_values_and_gradients(
        cpu: str, request, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight larger than one reused buffer (a tied LM head) is dequantized a panel of rows at a time
    into it, in forward and backward: only the order the panels' input gradients are summed in differs."""
    request.getfixturevalue(cpu)
    packed = block_weights()
    # 16-row panels: 3, 2 and 5 of them (the last one short in the first and last weight)
    monkeypatch.setattr(precision, "SCRATCH_MAX_VALUES", 16 * 512)
    monkeypatch.setattr(precision, "PANEL_MAX_VALUES", 16 * 512)
    monkeypatch.setattr(precision, "_scratch", threading.local())
    assert [len(precision._panels(p)) for p in packed] == [3, 1, 5]
    got_y, got_grad = chained_block_products(packed, dense=False)
    want_y, want_grad = chained_block_products(packed, dense=True)
    for a, b in zip(got_y, want_y, strict=True):   # each output is one row's whole dot product
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the input gradient sums the panels' products in float32; on bf16 dot products each panel's
    # product is rounded to bfloat16 (8 significant bits) where the whole weight's is rounded once
    bits = 7 if cpu == "bf16_cpu" else 20
    for a, b in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=float(b.abs().max()) * 2.0 ** -bits)
    buffers = precision._scratch.buffers
    assert max(buf.numel() for buf in buffers.values()) <= 16 * 512   # no buffer grew to a whole weight


def test_with_bf16_dot_products_the_backward_reads_the_weights_columns_transposed_with_the_dense_bits(
        bf16_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """grad @ W from W's columns dequantized transposed, 256 at a time (two panels of the 512-column
    weights): every panel is a slice of the product's outputs, so the gradients keep the dense copy's bits,
    and the buffer holds a panel, not the weight."""
    packed = block_weights()
    monkeypatch.setattr(precision, "COLUMN_PANEL_VALUES", 256)
    monkeypatch.setattr(precision, "_scratch", threading.local())
    columns: list[tuple[int, int]] = []
    real = type(packed[0]).dequantize_t

    def counted(self, dtype, start, stop, out=None, **kw):
        columns.append((start, stop))
        return real(self, dtype, start, stop, out, **kw)

    monkeypatch.setattr(type(packed[0]), "dequantize_t", counted)
    got_y, got_grad = chained_block_products(packed, dense=False)
    want_y, want_grad = chained_block_products(packed, dense=True)
    assert sorted(columns) == [(0, 256), (0, 256), (0, 256), (256, 512), (256, 512)]
    assert all(torch.equal(a, b) for a, b in zip(got_y, want_y, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_grad, want_grad, strict=True))
    assert precision._scratch.buffers[("columns", torch.bfloat16)].numel() == 256 * 72


def test_without_bf16_dot_products_the_backward_multiplies_the_blocks_in_cpp(avx2_cpu, monkeypatch) -> None:
    """In float32 grad @ W comes from the blocks (kernels/kquant_input_grad.cpp), no transposed copy of
    the weight: the kernel's bits, the dense copy's gradient up to float32 rounding."""
    if not kernels_available():
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    packed = block_weights()
    monkeypatch.setattr(type(packed[0]), "dequantize_t", lambda *a, **k: pytest.fail("transposed on AVX2"))
    got_y, got_grad = chained_block_products(packed, dense=False)
    _, want_grad = chained_block_products(packed, dense=True)
    for p, y, g in zip(packed, got_y, got_grad, strict=True):
        assert torch.equal(g, p.input_grad(2 * y))   # the loss is the outputs' squares
    assert_dense_gradients(got_grad, want_grad, "avx2_cpu")


def served_block_weights() -> list:
    """`block_weights` as `--quantization gguf` serves them: with 8-bit activations."""
    packed = block_weights()
    for p in packed:
        p.float_act = False
    return packed


def linear_loss_products(packed: list, dense: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each weight's output and the input gradient of a loss linear in it (so the gradient is grad @ W
    for the same grad whatever the forward computed)."""
    ys, grads = [], []
    for i, p in enumerate(packed):
        x = torch.randn(5, p.in_features, generator=torch.Generator().manual_seed(i), requires_grad=True)
        c = torch.randn(5, p.out_features, generator=torch.Generator().manual_seed(10 + i))
        y = (precision.mixed_linear(x, p.dequantize(torch.bfloat16), None) if dense
             else precision.block_linear(x, p, None, torch.bfloat16))
        (y * c).sum().backward()
        ys.append(y.detach())
        grads.append(x.grad)
    return ys, grads


@pytest.mark.parametrize("cpu", ["avx2_cpu", "bf16_cpu"])
def test_blocks_served_with_8_bit_activations_train_through_the_served_product(cpu: str, request) -> None:
    """Forward: the serving kernel's product (what the server answers with); backward: grad @ W over the
    dequantized weight, the dense copy's gradient (`assert_dense_gradients`)."""
    request.getfixturevalue(cpu)
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    from kiln.model.quant import quant_linear
    packed = served_block_weights()
    got_y, got_grad = linear_loss_products(packed, dense=False)
    _, want_grad = linear_loss_products(packed, dense=True)
    for i, (p, y) in enumerate(zip(packed, got_y, strict=True)):
        x = torch.randn(5, p.in_features, generator=torch.Generator().manual_seed(i))
        assert torch.equal(y, quant_linear(x, p))
        with torch.no_grad():   # scoring: the same product without autograd
            assert torch.equal(precision.block_linear(x, p, None, torch.bfloat16), y)
    assert_dense_gradients(got_grad, want_grad, cpu)


def test_the_kernels_on_torchs_threads_give_the_pools_bits() -> None:
    module = kernels.load()
    if module is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")
    from kiln.model.quant import quant_linear
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(3))
    for p in served_block_weights():
        x_ = x[:, :p.in_features]
        on_pool = quant_linear(x_, p)
        was = module.use_torch_threads(True)
        try:
            on_torch = quant_linear(x_, p)
        finally:
            module.use_torch_threads(was)
        assert not was and torch.equal(on_pool, on_torch)
