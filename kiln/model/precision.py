"""Which dtype torch's own matmuls run in: the model's, or float32 where half precision is emulated,
and float32 activations for every training forward on a CPU.

A bfloat16 model serves through Kiln's kernels on every AVX2 CPU (kiln/model/dense_tiles.py, the decode
stack), but training, prompt scoring and every other `forward_dense` run torch's ops on the same
weights. torch multiplies bfloat16 at the hardware's speed only with bf16 dot products (AVX512-BF16,
AMX); without them its oneDNN/MKL paths emulate it, measured 10x slower than float32 on a 2-core Zen 4
forced to AVX2 (SFT of the bench's learning loop: 1.2 vs 13.6 trained tok/s). There the dense path
widens each weight to float32 where it is used (`mixed_linear`) and keeps its activations in float32:
the conversion reads 2 bytes a weight once per projection, next to a training matmul's hundreds of
multiply-adds per weight. The serving path keeps the bfloat16 kernels, which widen in registers.

Training computes in float32 on every CPU (`training_dtype`), so a seeded job learns the same on every
ISA: with bf16 dot products only each frozen projection's product runs on them (`mixed_linear`).

A weight held only as a GGUF's quantized blocks (no dense copy) is multiplied as the server multiplies
it (`block_linear`). Served with 8-bit activations (`gguf`), the forward runs the serving kernel, on
torch's threads, and the backward multiplies the dequantized weight (the straight-through gradient of
the activations' rounding). Served with float activations (`gguf-float`), it is dequantized where it is
used, in forward and backward, to the values its dense copy would hold, into buffers each thread
reuses from one projection to the next: a fresh tensor of a projection's size faults in its pages on
every use, which cost more than the dequantization itself (a 1B model's 32 MB MLP weight: ~1.8 ns a
value to allocate and fill against ~0.2 to dequantize, on a loaded 2-core Zen 4). Where the backward
multiplies on bf16 dot products it dequantizes the weight's columns transposed (`grad @ W` reads that
layout faster), a panel of columns at a time: the same bits as the dense copy's product. Where it
multiplies in float32 (no bf16 dot products) a K-quant's `grad @ W` runs from the blocks in C++
(kernels/kquant_input_grad.cpp): the weight is read once, as its blocks, instead of dequantized, widened
and copied again into sgemm's panels; the same bits on every ISA, the dense copy's up to float32
rounding."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kiln.model import kernels
from kiln.model.quant import TILE_ROWS, kernels_available, quant_linear

# CPU flags (Linux names) of hardware dot products torch's CPU matmuls use for each half type
_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
# oneDNN caps (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA) that still allow bf16 dot products
_ONEDNN_BF16_CAPS = ("ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                     "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")


@functools.cache
def _torch_capability() -> str:
    """ATen's vector ISA ("AVX512", "AVX2", ...; ATEN_CPU_CAPABILITY lowers it), read once."""
    try:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    except (AttributeError, RuntimeError):
        return ""


def _onednn_capped() -> bool:
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(var, "").strip().upper()
        if cap and cap not in _ONEDNN_BF16_CAPS:
            return True
    return False


def native_half(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmuls in `dtype` (bfloat16 or float16) use hardware dot products here: the
    CPU has them, and neither Kiln's ISA (KILN_CPU_ISA=avx2 stands in for an AVX2-only CPU) nor torch's
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) is held below AVX-512."""
    flags = kernels.cpu_flags()
    if not any(flag in flags for flag in _NATIVE_FLAGS.get(dtype, ())):
        return False
    if kernels.active_isa() != "avx512" or _onednn_capped():
        return False
    return _torch_capability().startswith("AVX512")


def native_bf16() -> bool:
    """`native_half(torch.bfloat16)`."""
    return native_half(torch.bfloat16)


def training_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype a training forward computes its activations in over weights of `dtype`: float32 on
    every CPU. A LoRA update starts as zero and grows by about the learning rate a step; added to a
    bfloat16 residual stream (8 significant bits) most of it rounds away, and its gradients arrive
    through bfloat16 activations too, so on a CPU with bf16 dot products the same seeded job learned
    measurably less than on one without them. In float32 every ISA computes the same loss up to
    rounding; the frozen weights stay in their serving dtype (`mixed_linear` multiplies them).
    Accelerators keep `compute_dtype` (mixed precision is their native way)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    return compute_dtype(dtype, device)


def compute_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype torch's matmuls over weights of `dtype` should run in on `device`: float32 for a
    half-precision type the CPU would only emulate, else `dtype` itself."""
    if dtype in _NATIVE_FLAGS and torch.device(device).type == "cpu" and not native_half(dtype):
        return torch.float32
    return dtype


class _WidenedLinear(torch.autograd.Function):
    """`x @ W.T + b` with a frozen half-precision W widened to x's dtype, in forward and again in
    backward: autograd keeps the half-precision weight (a reference), never a float32 copy of it, so
    a long training forward holds no extra weights."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight)
        return _widened(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _widened(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _half_here(x: Tensor, weight: Tensor) -> bool:
    """float32 activations on a CPU with dot products in the weight's dtype: the product runs on them."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and native_half(weight.dtype)


def _half_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    y = F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


class _HalfProductLinear(torch.autograd.Function):
    """`x @ W.T + b` for float32 x over a frozen half-precision W where the CPU has dot products in
    W's dtype: the product runs on them (x rounded to W's dtype, float32 sums rounded once on the way
    out), the bias is added in float32, and the gradient for x is the same kind of product. Only the
    rounding of one product's inputs and output differs from widening W; everything around it (the
    residual stream, norms, attention, LoRA, the loss) stays float32, and autograd keeps no copy of W."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(weight)
        return _half_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return (grad.to(weight.dtype) @ weight).to(grad.dtype), None, None


def mixed_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(x, weight, bias)` in x's dtype when the weight is stored narrower (float32 activations
    over bfloat16 weights). With hardware dot products in the weight's dtype (`native_half`) the
    product runs on them: 1.9x less CPU time per training step than widening on a Zen 4 (SmolLM2-135M,
    one 56-token row, one thread: 0.42 against 0.86 s) and within rounding of it. Without them each
    weight is widened where it is used."""
    if x.dtype == weight.dtype:
        return F.linear(x, weight, bias)
    trains_weight = weight.requires_grad or (bias is not None and bias.requires_grad)
    if trains_weight:
        # a trained weight: the cast is part of the graph
        return _widened(x, weight, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        return (_HalfProductLinear if _half_here(x, weight) else _WidenedLinear).apply(x, weight, bias)
    # no autograd through x (inference, reference log-probs): the same values as the training forward
    return _product(x, weight, bias)


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`mixed_linear`'s values for a frozen weight, without autograd."""
    if x.dtype == weight.dtype:
        return F.linear(x, weight, bias)
    return _half_product(x, weight, bias) if _half_here(x, weight) else _widened(x, weight, bias)


def _input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    if grad.dtype == weight.dtype:
        return grad @ weight
    if grad.dtype == torch.float32 and grad.device.type == "cpu" and native_half(weight.dtype):
        return (grad.to(weight.dtype) @ weight).to(grad.dtype)
    return grad @ weight.to(grad.dtype)


# The largest weight (values) dequantized whole into a reused buffer: every projection of an 8B model
# (its MLP's 14336 x 4096). A larger one (a 1B model's 49152-row tied LM head) goes in panels of rows of
# at most `PANEL_MAX_VALUES` values through the same buffers: a fresh tensor of its size (200 MB in
# bfloat16) faulted in its pages twice a step (measured: 3.9 against 2.8 s a step of the learning loop at
# 1B, one thread), and no thread keeps more than a projection's worth of buffers alive.
SCRATCH_MAX_VALUES = 64 << 20
PANEL_MAX_VALUES = 16 << 20

_scratch = threading.local()


def _buffer(slot: str, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """This thread's buffer `slot` viewed as `shape`, grown when too small; its contents are the last
    caller's until overwritten."""
    numel = shape[0] * shape[1]
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        del buf
        buffers.pop((slot, dtype), None)   # the old buffer freed before the larger one is taken
        buffers[(slot, dtype)] = buf = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


def _reusable(packed: Any) -> bool:
    """Whether the C++ dequantizer can write `packed` into this thread's buffers."""
    return bool(packed.is_kquant and packed.qs.is_cpu)


def _block_weight(packed: Any, dtype: torch.dtype, x: Tensor) -> Tensor:
    """W = `packed.dequantize(dtype)` for a product with x, valid until this thread's next call: in the
    thread's reused buffers, and widened to x's dtype there when the product would widen it anyway
    (exact: the same values `_widened` multiplies). `packed` fits `SCRATCH_MAX_VALUES` (or is not
    `_reusable`: then a temporary). The C++ pass runs on torch's threads, the ones the product then runs
    on: the kernels' own pool would add a third busy thread on two cores while torch's workers still spin
    after the previous product."""
    shape = (packed.out_features, packed.in_features)
    if not _reusable(packed):
        return packed.dequantize(dtype)
    weight = packed.dequantize(dtype, out=_buffer("weight", shape, dtype), torch_threads=True)
    if x.dtype != weight.dtype and x.dtype == torch.float32 and not _half_here(x, weight):
        weight = _buffer("widened", shape, x.dtype).copy_(weight)
    return weight


def _panels(packed: Any) -> list[tuple[int, Any]]:
    """(first row, the rows' PackedWeight) covering `packed` in panels of whole tiles of at most
    `PANEL_MAX_VALUES` values each; one panel, itself, when it fits `SCRATCH_MAX_VALUES` or cannot be
    reused."""
    if not _reusable(packed) or packed.out_features * packed.in_features <= SCRATCH_MAX_VALUES:
        return [(0, packed)]
    tiles = max(1, PANEL_MAX_VALUES // (TILE_ROWS * packed.in_features))
    return [(t * TILE_ROWS, packed._tile_range(t, t + tiles)) for t in range(0, packed.qs.shape[0], tiles)]


def _block_product(x: Tensor, packed: Any, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    panels = _panels(packed)
    if len(panels) == 1:
        weight = _block_weight(packed, dtype, x)
        if bias is not None and weight.dtype == x.dtype:
            bias = bias.to(x.dtype)
        return _product(x, weight, bias)
    # each panel's outputs are their rows' dot products, as the whole weight's product computes them
    y = x.new_empty(*x.shape[:-1], packed.out_features)
    for row, part in panels:
        y[..., row:row + part.out_features] = _product(x, _block_weight(part, dtype, x), None)
    return y if bias is None else y + bias.to(x.dtype)


# Values of a weight's transposed columns the backward dequantizes at a time (a multiple of 256
# columns, at least 256): a panel stays in the caches between its dequantization and its product.
COLUMN_PANEL_VALUES = 4 << 20


def _column_panels(packed: Any, dtype: torch.dtype, grad: Tensor) -> int:
    """How many columns of W `_columns_input_grad` dequantizes at a time for grad @ W; 0 where it does
    not run: the product is not on bf16 dot products (a float32 product's result could depend on the
    layout), the C++ pass cannot write the weight, or 256 columns exceed `PANEL_MAX_VALUES`."""
    if not (dtype == torch.bfloat16 and _reusable(packed) and grad.dtype == torch.float32
            and grad.device.type == "cpu" and native_half(dtype)):
        return 0
    n, k = packed.out_features, packed.in_features
    if 256 * n > PANEL_MAX_VALUES:
        return 0
    return min(k, max(256, min(COLUMN_PANEL_VALUES, PANEL_MAX_VALUES) // n // 256 * 256))


def _columns_input_grad(grad: Tensor, packed: Any, dtype: torch.dtype, width: int) -> Tensor:
    """grad @ W on bf16 dot products, W's columns dequantized transposed `width` at a time: grad @ W
    reads W^T faster than W (oneDNN: ~20% less time at 1B's shapes), and a panel of columns gives a
    slice of the product's outputs, each the whole dot product: the bits `_input_grad` gives."""
    n, k = packed.out_features, packed.in_features
    g = grad.to(dtype)
    if width >= k:
        wt = packed.dequantize_t(dtype, 0, k, out=_buffer("columns", (k, n), dtype), torch_threads=True)
        return F.linear(g, wt).to(grad.dtype)
    out = grad.new_empty(*grad.shape[:-1], k)
    for k0 in range(0, k, width):
        k1 = min(k, k0 + width)
        wt = packed.dequantize_t(dtype, k0, k1, out=_buffer("columns", (k1 - k0, n), dtype), torch_threads=True)
        out[..., k0:k1] = F.linear(g, wt)
    return out


def _kernel_input_grad(grad: Tensor, packed: Any, dtype: torch.dtype) -> Tensor | None:
    """grad @ W multiplied from W's blocks in C++ (`PackedWeight.input_grad`) where the product runs in
    float32 anyway: bfloat16 values, float32 grads, no bf16 dot products. Through torch it dequantized W,
    widened it to a float32 copy and sgemm copied that into its panels, three passes over a weight as long
    as the multiply-adds at a step's few dozen rows; from the blocks a 1B model's projections took
    0.5-0.6x the time at 60 rows and 0.8-0.9x at 200 (2-core AMD EPYC Zen 3, AVX2). Every ISA gives the
    same bits; they are the dense copy's gradient up to float32 rounding (its sums run in another order)."""
    if dtype != torch.bfloat16 or native_half(dtype):
        return None
    return packed.input_grad(grad)   # None unless a K-quant on the CPU with float32 grads and the kernels


def _block_input_grad(grad: Tensor, packed: Any, dtype: torch.dtype) -> Tensor:
    """grad @ W. On bf16 dot products from W's columns transposed (`_columns_input_grad`); in float32
    from the blocks in C++ (`_kernel_input_grad`); else for a weight over the bound panel by panel, each
    panel's product as `_input_grad` computes it and the partial sums added in grad's dtype. Widening
    every panel to float32 instead took 2.6x as long for a 1B model's LM head."""
    width = _column_panels(packed, dtype, grad)
    if width:
        return _columns_input_grad(grad, packed, dtype, width)
    direct = _kernel_input_grad(grad, packed, dtype)
    if direct is not None:
        return direct
    panels = _panels(packed)
    if len(panels) == 1:
        return _input_grad(grad, _block_weight(packed, dtype, grad))
    total: Tensor | None = None
    for row, part in panels:
        g = _input_grad(grad[..., row:row + part.out_features], _block_weight(part, dtype, grad))
        total = g if total is None else total.add_(g)
    assert total is not None
    return total


def served_product(packed: Any, x: Tensor) -> bool:
    """Whether the product with `packed` runs the serving kernel with 8-bit activations (the weight is
    served that way, `--quantization gguf`, and the kernel runs here) rather than over its dequantized
    values."""
    return not packed.float_act and x.device.type == "cpu" and packed.qs.is_cpu and kernels_available()


def _forward_product(x: Tensor, packed: Any, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    if not served_product(packed, x):
        return _block_product(x, packed, bias, dtype)
    # on torch's threads, as the dequantization: between torch's ops the kernels' own pool would
    # compete with its spinning workers (a 1B MLP product took twice as long)
    module = kernels.load()
    was = module.use_torch_threads(True)
    try:
        return quant_linear(x.detach(), packed, None if bias is None else bias.to(x.dtype))
    finally:
        module.use_torch_threads(was)


class _BlockLinear(torch.autograd.Function):
    """`x @ W.T + b` for a frozen weight held only as quantized blocks: the forward is the product the
    server computes (`block_linear`), the backward multiplies W dequantized into the thread's buffer, and
    autograd keeps only the blocks (a reference), so no dense copy of the weight outlives the call."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, packed: Any, dtype: torch.dtype) -> Tensor:
        ctx.packed, ctx.dtype = packed, dtype
        return _forward_product(x, packed, bias, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _block_input_grad(grad, ctx.packed, ctx.dtype), None, None, None


def block_linear(x: Tensor, packed: Any, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """`x @ W.T + b` for a frozen weight held only as a GGUF's blocks (`packed`, `dtype` the dense
    weight's it stands in for), as the server multiplies it. Served with float activations
    (`gguf-float`): `mixed_linear(x, W, bias)` for W = `packed.dequantize(dtype)`, the dense copy's
    values computed from the blocks per call. Served with 8-bit activations (`gguf`, auto's choice for
    K-quants on a CPU with the kernels): the serving kernel's product, so training and scoring see the
    model the server answers with, at the kernel's speed (a 1B Q4_K_M layer's forward over 54 tokens:
    ~10 ms against ~26 ms dequantized, 2-core Zen 4); its gradient for x is grad @ W over the
    dequantized W, the straight-through gradient of the activations' rounding (as quantization-aware
    training takes it). The bias stays frozen, as in `mixed_linear`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _BlockLinear.apply(x, bias, packed, dtype)
    return _forward_product(x, packed, bias, dtype)
