"""Our decoder (llama / qwen2 / qwen3), with a paged serving path and a dense autograd path.

Module names follow transformers (`model.layers.N.self_attn.q_proj`, ...) so HF checkpoints and
PEFT adapter keys map 1:1. Attention never repeats K/V for GQA: in the paged path the query heads
of one KV group are folded into the query-length axis, so one SDPA per group of sequences covers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.model import kernels
from kiln.model.config import ModelConfig
from kiln.model.decode_stack import FusedProjection, build_decode_stack, clear_fused
from kiln.model.dense_tiles import dense_linear, tiles_linear
from kiln.model.kv_cache import AttentionMetadata, KVCache, resolve_torch_dtype
from kiln.model.lora import KERNEL_DTYPES, BankRouting, LoraBank, LoraDelta, LoraStep
from kiln.model.lora import MODULES as LORA_MODULES
from kiln.model.precision import block_linear, compute_dtype, mixed_linear
from kiln.model.quant import PackedWeight, holds_no_values, quant_linear
from kiln.model.rope import RotaryTables, apply_rope


class Linear(nn.Linear):
    """nn.Linear (so PEFT recognises it) that skips the init a checkpoint would overwrite."""

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: Tensor) -> Tensor:
        packed = getattr(self, "packed", None)
        if packed is not None and holds_no_values(self.weight):
            # the weight lives only in its GGUF blocks: dequantized here, per call (precision.py)
            return block_linear(x, packed, self.bias, self.weight.dtype)
        # float32 activations over bfloat16 weights: the dense path on a CPU without bf16 dot products
        return mixed_linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass

    def forward(self, input_ids: Tensor) -> Tensor:
        packed = getattr(self, "packed", None)
        if packed is not None and holds_no_values(self.weight):
            # a table held only as its GGUF blocks: the looked-up rows are dequantized, nothing else
            return packed.dequantize_rows(input_ids, self.weight.dtype)
        return super().forward(input_ids)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, self.weight.shape, weight, self.eps)

    def fast(self, x: Tensor) -> Tensor:
        """The serving path's norm of flat tokens `[T, n]`: one C++ call when the kernels are built."""
        module = cpu_kernels(x)
        if module is None or x.dtype != self.weight.dtype:
            return self.forward(x)
        return module.rms_norm(x, self.weight, self.eps)


# module-level name (not a direct call) so tests can force the torch ops
cpu_kernels = kernels.for_tensor
# steps of a packed or bf16-tiled model whose every token attends on the kernel (decodes, short
# prompts) run every layer in one C++ call (tests turn it off to compare)
use_decode_stack = True


@dataclass
class _StepContext:
    """What every layer of one paged forward shares, computed once per step."""

    cos: Tensor                     # [T, 1, head_dim]
    sin: Tensor
    attn: AttentionMetadata
    decode_mask: Tensor | None      # [Bd, 1, 1, Lmax] bool, None when no padding is possible
    prefill_masks: list[Tensor | None]   # [n*groups, L] bool per chunk, None for a chunk with no prefix
    lora: LoraDelta | None = None   # set only when some token of the step uses an adapter
    kernels: Any = None   # the C++ ops (CPU): decodes then need no mask, their slots and lengths suffice
    # per chunk, for its first queries that attend on the kernels (None: none does): every such
    # query's slot row (one row, stride 0) and context length (query i of n over L positions sees
    # L - n + i + 1); prefill_masks then cover the chunk's other queries
    chunk_rows: list[tuple[Tensor, Tensor] | None] | None = None


def _dense_rows(t: Tensor) -> Tensor:
    """`t` `[T, H, D]` itself when each token's row is dense (a row view of a fused projection's
    output is), else a contiguous copy: what the kernels' rotary and attention read."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def project(linear: nn.Linear, x: Tensor, lora: LoraDelta | None, layer: int, name: str,
            packed_ok: bool = False) -> Tensor:
    """Base projection for the whole batch, plus each token's own LoRA delta when it has one.

    `packed_ok` (the serving path) multiplies with the quantized weights when the model has them, or
    with the bfloat16 tiles of the C++ dense kernel (kiln/model/dense_tiles.py)."""
    packed = getattr(linear, "packed", None) if packed_ok else None
    if packed is not None:
        y = quant_linear(x, packed, linear.bias)
    else:
        y = dense_linear(x, linear) if packed_ok else linear(x)
    return y if lora is None else lora.apply(y, x, layer, name)


def project_fused(fused: FusedProjection | None, x: Tensor, lora: LoraDelta | None, layer: int,
                  names: tuple[str, ...]) -> list[Tensor] | None:
    """The serving path's projections of one input (q|k|v, gate|up) in one call of their fused weight
    (kiln/model/decode_stack.py): the input quantized or widened once, not once per projection, and
    the same values as `project` per part. None where the kernels do not run: `project` then serves."""
    if fused is None:
        return None
    module = cpu_kernels(x)
    if module is None:
        return None
    w = fused.weight
    if isinstance(w, PackedWeight):
        y = quant_linear(x, w, fused.bias)
    elif x.dtype == torch.bfloat16:
        y = tiles_linear(module, x, w, fused.bias)
    else:
        return None
    parts = list(y.split(fused.sizes, dim=-1))
    if lora is not None:
        parts = [lora.apply(part, x, layer, name) for part, name in zip(parts, names, strict=True)]
    return parts


def _stack_takes(lora: LoraDelta | None) -> bool:
    """The stack adds adapters' deltas itself only for a serving bank the BGMV kernel reads."""
    return lora is None or (isinstance(lora, BankRouting) and lora.bank.dtype in KERNEL_DTYPES)


def _prompts_on_kernel(ctx: _StepContext) -> bool:
    """Every query of every prompt chunk of the step attends on the kernel."""
    rows = ctx.chunk_rows
    return rows is not None and all(r is not None and r[1].numel() == c.query_len
                                    for r, c in zip(rows, ctx.attn.prefills, strict=True))


def _step_context_rows(ctx: _StepContext) -> tuple[Tensor, Tensor, Tensor | None]:
    """paged_attention's slots `[T, L]` and lengths `[T]` for every token of a step that attends on
    the kernel (the decodes' rows, then each prompt chunk's shared row once per query), and how many
    rows each unit holds (None: one each; a prompt chunk is one, whose queries read the K/V its earlier
    rows write in the same layer: a part of a split step that starts inside one waits for them)."""
    attn = ctx.attn
    if not attn.prefills:
        return attn.decode_context_slots, attn.decode_context_lens, None
    parts = [(attn.decode_context_slots, attn.decode_context_lens)] if attn.num_decode_tokens else []
    parts += [r for r in ctx.chunk_rows or () if r is not None]
    slots = torch.zeros((sum(int(n.numel()) for _, n in parts), max(int(s.shape[1]) for s, _ in parts)),
                        dtype=torch.int64, device=attn.slot_mapping.device)
    row = 0
    for s, _ in parts:
        slots[row:row + s.shape[0], :s.shape[1]] = s
        row += s.shape[0]
    units = [1] * attn.num_decode_tokens + [c.query_len for c in attn.prefills]
    return slots, torch.cat([n for _, n in parts]), torch.tensor(units, dtype=torch.int64)


def _stack_lora(lora: LoraDelta | None, rows: int) -> tuple[Any, list[Tensor | None], list[Tensor | None]]:
    """DecodeStack.forward's adapter arguments: a slot for each of the step's `rows` (decodes and prompt
    chunks alike) and each module's factors (None: unused)."""
    slots = lora.step.row_slots if isinstance(lora, BankRouting) else None
    if slots is None:
        return None, [], []
    if slots.numel() < rows:   # row_slots ends at the last row with an adapter: the rest are the base
        slots = torch.cat([slots, slots.new_zeros(rows - slots.numel())])
    bank = lora.bank
    return (slots, [bank.a[m] if bank.used[m] else None for m in LORA_MODULES],
            [bank.b[m] if bank.used[m] else None for m in LORA_MODULES])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, **factory: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.groups = cfg.num_query_groups
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias, **factory)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias, **factory)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias, **factory)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False, **factory)
        # q|k|v as one weight for the serving path (kiln/model/decode_stack.py's fuse_projections)
        self.fused_qkv: FusedProjection | None = None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, **factory)

    def _qkv(self, x: Tensor, cos: Tensor | None, sin: Tensor | None, lora: LoraDelta | None = None,
             packed_ok: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """x `[..., hidden]` -> q `[..., H, D]`, k and v `[..., Hkv, D]`; rotary applied unless cos is None."""
        lead = x.shape[:-1]
        li = self.layer_idx
        parts = project_fused(self.fused_qkv, x, lora, li, ("q_proj", "k_proj", "v_proj")) if packed_ok else None
        if parts is None:
            parts = [project(self.q_proj, x, lora, li, "q_proj", packed_ok),
                     project(self.k_proj, x, lora, li, "k_proj", packed_ok),
                     project(self.v_proj, x, lora, li, "v_proj", packed_ok)]
        q = parts[0].view(*lead, self.num_heads, self.head_dim)
        k = parts[1].view(*lead, self.num_kv_heads, self.head_dim)
        v = parts[2].view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if cos is None or sin is None:
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_paged(self, x: Tensor, ctx: _StepContext, k_cache: Tensor, v_cache: Tensor,
                      rows: Tensor | None = None) -> Tensor:
        """Every token's K/V into the cache; the attention output of `rows` only (None: all tokens)."""
        attn = ctx.attn
        kern = ctx.kernels
        if kern is not None and ctx.cos.dtype == k_cache.dtype:
            q, k, v = self._qkv(x, None, None, ctx.lora, packed_ok=True)
            # the kernels read q and the cache in one dtype (and no decode mask was built for torch);
            # they take each token's [H, D] row where it lies, as a row view of the fused projection
            q, k, v = (_dense_rows(t.to(k_cache.dtype)) for t in (q, k, v))
            kern.rope_and_cache(q, k, v, ctx.cos, ctx.sin, k_cache, v_cache, attn.slot_mapping)
        else:
            q, k, v = self._qkv(x, ctx.cos, ctx.sin, ctx.lora, packed_ok=True)
            k_cache.index_copy_(0, attn.slot_mapping, k.to(k_cache.dtype))
            v_cache.index_copy_(0, attn.slot_mapping, v.to(k_cache.dtype))
            if kern is not None:
                q, k, v = q.to(k_cache.dtype), k.to(k_cache.dtype), v.to(k_cache.dtype)
        parts: list[Tensor] = []
        bd = attn.num_decode_tokens
        scale = self.head_dim ** -0.5
        if bd and kern is not None:
            # reads each context in place through the slot table: no gather, no padding mask
            parts.append(kern.paged_attention(q[:bd], k_cache, v_cache, attn.decode_context_slots,
                                              attn.decode_context_lens, scale))
        elif bd:
            parts.append(self._decode(q[:bd], attn.decode_context_slots, ctx.decode_mask, k_cache, v_cache))
        # A chunk's queries below kernels.chunk_attention_kernel_positions() run on the kernel (each
        # then gets exactly the bits a decode of it would), the rest on torch's SDPA.
        for i, (chunk, mask) in enumerate(zip(attn.prefills, ctx.prefill_masks, strict=True)):
            start, n = chunk.query_start, chunk.query_len
            on_kernel = 0
            if ctx.chunk_rows is not None and ctx.chunk_rows[i] is not None:
                slots, lens = ctx.chunk_rows[i]
                on_kernel = lens.numel()
                parts.append(kern.paged_attention(q[start:start + on_kernel], k_cache, v_cache, slots, lens, scale))
            if on_kernel == n:
                continue
            sl = slice(start + on_kernel, start + n)
            if mask is None:
                parts.append(self._prefill_fresh(q[sl], k[sl], v[sl]))
            else:
                ck = k_cache.index_select(0, chunk.context_slots)
                cv = v_cache.index_select(0, chunk.context_slots)
                parts.append(self._prefill_with_context(q[sl], ck, cv, mask))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if rows is not None:
            out = out.index_select(0, rows)
        return project(self.o_proj, out.to(x.dtype), ctx.lora, self.layer_idx, "o_proj", packed_ok=True)

    def _decode(self, q: Tensor, slots: Tensor, mask: Tensor | None, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        bd, lmax = slots.shape
        flat = slots.reshape(-1)
        # [Bd, Hkv, Lmax, D]; the query heads of a KV head ride on the query-length axis
        ck = k_cache.index_select(0, flat).view(bd, lmax, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cv = v_cache.index_select(0, flat).view(bd, lmax, self.num_kv_heads, self.head_dim).transpose(1, 2)
        qg = q.view(bd, self.num_kv_heads, self.groups, self.head_dim)
        out = F.scaled_dot_product_attention(qg, ck, cv, attn_mask=mask)
        return out.reshape(bd, self.num_heads * self.head_dim)

    def _prefill_fresh(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = q.shape[0]
        dtype = q.dtype
        if q.is_cpu and dtype == torch.bfloat16:
            # torch's CPU flash attention is faster in float32 than in bfloat16 (measured 4.3 vs 5.8 ms
            # a layer for a 500-token prompt; the same at 100), and no less exact
            q, k, v = q.float(), k.float(), v.float()
        # 4-D inputs: the CPU flash kernel does not take 3-D ones (they fall back to the math path)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True,
        )
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim).to(dtype)

    def _prefill_with_context(self, q: Tensor, ck: Tensor, cv: Tensor, mask: Tensor) -> Tensor:
        n = q.shape[0]
        dtype = q.dtype
        if q.is_cpu and dtype == torch.bfloat16:
            # float32 like _prefill_fresh: a prompt read over a cached prefix must give what the same
            # prompt read fresh gives (concurrent requests equal sequential ones)
            q, ck, cv = q.float(), ck.float(), cv.float()
        # [Hkv, n*groups, D] with row i*groups+g = query i, head g of the KV group
        qg = q.view(n, self.num_kv_heads, self.groups, self.head_dim).transpose(0, 1)
        qg = qg.reshape(self.num_kv_heads, n * self.groups, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg[None], ck.transpose(0, 1)[None], cv.transpose(0, 1)[None], attn_mask=mask[None, None]
        )[0]
        out = out.view(self.num_kv_heads, n, self.groups, self.head_dim).transpose(0, 1)
        return out.reshape(n, self.num_heads * self.head_dim).to(dtype)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                      lora: LoraDelta | None = None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin, lora)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None, enable_gqa=True,
        )
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return project(self.o_proj, out, lora, self.layer_idx, "o_proj")


def silu_mul(gate: Tensor, up: Tensor, serving: bool) -> Tensor:
    """silu(gate) * up. The serving path of CPU tensors takes the kernel the decode stack takes: ATen's
    silu rounds a row's last few elements differently from the rest, so where a row ends would
    otherwise decide bits that the stack and this path must share."""
    module = cpu_kernels(gate) if serving and gate.dim() == 2 and not up.requires_grad else None
    if module is None or gate.dtype not in (torch.float32, torch.bfloat16) or up.dtype != gate.dtype:
        return F.silu(gate) * up
    return module.silu_mul(gate, up)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, **factory: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, **factory)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, **factory)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, **factory)
        self.fused_gate_up: FusedProjection | None = None

    def forward(self, x: Tensor, lora: LoraDelta | None = None, packed_ok: bool = False) -> Tensor:
        li = self.layer_idx
        parts = project_fused(self.fused_gate_up, x, lora, li, ("gate_proj", "up_proj")) if packed_ok else None
        if parts is None:
            parts = [project(self.gate_proj, x, lora, li, "gate_proj", packed_ok),
                     project(self.up_proj, x, lora, li, "up_proj", packed_ok)]
        gate, up = parts
        return project(self.down_proj, silu_mul(gate, up, packed_ok), lora, li, "down_proj", packed_ok)


def _residual(h: Tensor, delta: Tensor) -> Tensor:
    """h + delta; in place, on the kernels' pool, where they run (the serving path's h is its own)."""
    module = cpu_kernels(h)
    if (module is None or h.dtype != delta.dtype or h.dtype not in (torch.float32, torch.bfloat16)
            or h.shape != delta.shape or not h.is_contiguous() or not delta.is_contiguous()):
        return h + delta
    module.add_inplace(h, delta)
    return h


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, **factory)
        self.mlp = MLP(cfg, layer_idx, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)

    def forward_paged(self, h: Tensor, ctx: _StepContext, k_cache: Tensor, v_cache: Tensor,
                      rows: Tensor | None = None) -> Tensor:
        """`rows` (None: all): the tokens whose output is wanted; the others only fill the cache."""
        a = self.self_attn.forward_paged(self.input_layernorm.fast(h), ctx, k_cache, v_cache, rows)
        h = _residual(h if rows is None else h.index_select(0, rows), a)
        return _residual(h, self.mlp(self.post_attention_layernorm.fast(h), ctx.lora, packed_ok=True))

    def forward_dense(self, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                      lora: LoraDelta | None = None) -> Tensor:
        h = h + self.self_attn.forward_dense(self.input_layernorm(h), cos, sin, mask, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **factory) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)


class Transformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        *,
        init_weights: bool = True,
    ) -> None:
        """`init_weights=False` leaves the parameters uninitialised (allocated lazily, never touched)
        for `load_state_dict_hf` to replace. The meta device is avoided on purpose: its first use
        imports sympy and friends, over a second of startup."""
        super().__init__()
        self.config = config
        dtype = resolve_torch_dtype(dtype)
        factory = {"dtype": dtype, "device": device}
        self.model = Backbone(config, **factory)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self._tie()
        if init_weights:
            self._init_weights()
        self.rotary = RotaryTables(config, dtype, device)
        # Adapters being served; the engine installs and grows it (never part of the state dict).
        self.lora_bank: LoraBank | None = None
        # the C++ DecodeStack once built; False when this model cannot use one
        self._decode_stack: Any = None

    @property
    def device(self) -> torch.device:
        return self.rotary.cos.device

    @property
    def dtype(self) -> torch.dtype:
        return self.rotary.cos.dtype

    @property
    def dense_dtype(self) -> torch.dtype:
        """What the dense (autograd) path computes in: float32 over bfloat16 weights on a CPU without
        bf16 dot products, where torch would emulate them (kiln/model/precision.py), else `dtype`."""
        return compute_dtype(self.dtype, self.device)

    def embed_dense(self, input_ids: Tensor) -> Tensor:
        """The dense path's input embeddings, in `dense_dtype`."""
        h = self.model.embed_tokens(input_ids)
        dtype = self.dense_dtype
        return h if h.dtype == dtype else h.to(dtype)

    def _tie(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def load_state_dict_hf(self, tensors: dict[str, Tensor]) -> None:
        """Adopt HF-named tensors as the parameters (converted only when dtype/device differ).

        Every parameter must be present (a tied head may omit `lm_head.weight`); unknown keys are
        an error, except rotary caches old checkpoints carry.
        """
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in tensors]
        unexpected = [
            n for n in tensors
            if n not in params and not n.endswith("rotary_emb.inv_freq")
            and not (n == "lm_head.weight" and self.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        device, dtype = self.device, self.dtype
        for name, param in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape {tuple(param.shape)}")
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            data = t.to(device=device, dtype=dtype)
            setattr(module, leaf, nn.Parameter(data, requires_grad=param.requires_grad))
        self._tie()

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata, kv_cache: KVCache,
                lora: LoraStep | None = None, launched: Callable[[], None] | None = None,
                out_rows: list[int] | None = None, logits: bool = False) -> Tensor:
        """Paged serving path over flat tokens `[T]` (decodes first); returns final hidden `[T, hidden]`,
        or with a non-empty `out_rows` (flat indices, in order) those tokens' rows only; with `logits`
        their float32 logits instead (`compute_logits(..., packed_ok=True)` of those rows).

        `lora` routes tokens to adapter slots of `self.lora_bank` (None: every token uses the base).
        `launched` is called just before the layers run (on the C++ stack: without the GIL).
        With `out_rows` the last layer still writes every token's K/V, but its attention output,
        o_proj and MLP run for those rows only (as llama.cpp does for the tokens it does not sample):
        a prompt chunk's other tokens need nothing past their last K/V. Each row's values are the
        ones the full batch gives it (every op is row-wise), so nothing else changes."""
        with torch.no_grad():
            ctx = self._step_context(positions, attn)
            if lora is not None and self.lora_bank is not None:
                ctx.lora = BankRouting(self.lora_bank, lora)
            h = self.model.embed_tokens(input_ids)
            index = (torch.tensor(out_rows, dtype=torch.long, device=h.device)
                     if out_rows and len(out_rows) < h.shape[0] else None)
            stack = self._stack_for(ctx, h, kv_cache)
            if launched is not None:
                launched()
            if stack is not None:
                slots, lens, units = _step_context_rows(ctx)
                head = logits and stack.has_head
                h = stack.forward(h, ctx.cos, ctx.sin, kv_cache.storage, attn.slot_mapping, slots, lens,
                                  self.config.head_dim ** -0.5, *_stack_lora(ctx.lora, h.shape[0]),
                                  out_rows=index, units=units, logits=head)
                if head:   # the final norm and the LM head ran in the stack, on each part's rows
                    return h
            else:
                last = len(self.model.layers) - 1
                # adapters route by the step's token layout, so a step with any keeps every row
                rows = index if ctx.lora is None else None
                for i, layer in enumerate(self.model.layers):
                    h = layer.forward_paged(h, ctx, kv_cache.k[i], kv_cache.v[i], rows if i == last else None)
            if index is not None and h.shape[0] != index.numel():
                h = h.index_select(0, index)
            h = self.model.norm.fast(h)
            return self.compute_logits(h, packed_ok=True) if logits else h

    def _stack_for(self, ctx: _StepContext, h: Tensor, kv_cache: KVCache) -> Any:
        """The C++ DecodeStack when this step may use it: every token attends on the kernel, adapters
        from the serving bank, one dtype throughout."""
        kern = ctx.kernels
        if (kern is None or not use_decode_stack or not _stack_takes(ctx.lora)
                or (ctx.attn.prefills and not _prompts_on_kernel(ctx))
                or self._decode_stack is False
                or not (h.dtype == ctx.cos.dtype == kv_cache.dtype == self.model.norm.weight.dtype)):
            return None
        if self._decode_stack is None:
            self._decode_stack = build_decode_stack(self, kern) or False
        return self._decode_stack or None

    def _step_context(self, positions: Tensor, attn: AttentionMetadata) -> _StepContext:
        self.rotary.ensure(attn.max_context_len)
        cos = self.rotary.cos.index_select(0, positions).unsqueeze(1)
        sin = self.rotary.sin_signed.index_select(0, positions).unsqueeze(1)
        kern = cpu_kernels(cos) if cos.dtype in (torch.float32, torch.bfloat16) else None
        decode_mask = None
        bd = attn.num_decode_tokens
        if bd > 1 and kern is None:
            lmax = attn.decode_context_slots.shape[1]
            ar = torch.arange(lmax, device=positions.device)
            decode_mask = (ar[None, :] < attn.decode_context_lens[:, None]).view(bd, 1, 1, lmax)
        groups = self.config.num_query_groups
        on_kernel = kernels.chunk_attention_kernel_positions() if kern is not None and attn.prefills else 0
        prefill_masks: list[Tensor | None] = []
        rows: list[tuple[Tensor, Tensor] | None] = []
        for chunk in attn.prefills:
            n, length = chunk.query_len, chunk.context_len
            first = length - n   # the chunk's first query's position
            k = min(n, max(0, on_kernel - first))   # its queries that attend on the kernel
            rows.append((chunk.context_slots.view(1, length).expand(k, length),
                         torch.arange(first + 1, first + k + 1, dtype=torch.int64)) if k else None)
            if k == n or (k == 0 and n == length):
                prefill_masks.append(None)
                continue
            q_pos = torch.arange(first + k, length, device=positions.device)
            mask = torch.arange(length, device=positions.device)[None, :] <= q_pos[:, None]
            prefill_masks.append(mask.repeat_interleave(groups, dim=0))
        return _StepContext(cos, sin, attn, decode_mask, prefill_masks, kernels=kern,
                            chunk_rows=rows if any(r is not None for r in rows) else None)

    def forward_dense(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                      lora: LoraDelta | None = None) -> Tensor:
        """Causal forward over `[B, T]` with autograd and no cache; returns float32 logits `[B, T, V]`.

        With `attention_mask` (1 = token, 0 = padding) positions count only real tokens, so left and
        right padding both give each sequence the logits it would get alone.
        """
        b, t = input_ids.shape
        self.rotary.ensure(t)
        if attention_mask is None:
            cos = self.rotary.cos[:t][None, :, None, :]
            sin = self.rotary.sin_signed[:t][None, :, None, :]
            mask = None
        else:
            am = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            pos = (am.long().cumsum(-1) - 1).clamp_min(0)
            cos = self.rotary.cos[pos].unsqueeze(2)
            sin = self.rotary.sin_signed[pos].unsqueeze(2)
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            # the diagonal stays visible so padded query rows never see an all-masked row (NaN)
            mask = (causal[None] & am[:, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
            mask = mask[:, None]
        h = self.embed_dense(input_ids)
        for layer in self.model.layers:
            h = layer.forward_dense(h, cos, sin, mask, lora)
        return self.compute_logits(self.model.norm(h))

    def compute_logits(self, hidden: Tensor, packed_ok: bool = False) -> Tensor:
        """float32 logits; `packed_ok` (the serving path) uses the quantized LM head when there is one."""
        packed = getattr(self.lm_head, "packed", None) if packed_ok else None
        if packed is not None:
            # float32 in, float32 out: the kernel quantizes the same activations either way, and its
            # float32 sums are kept instead of being rounded to bfloat16 and widened again
            return quant_linear(hidden.float(), packed)
        if packed_ok:
            # float32 sums: bfloat16 logits 0.125 apart near 25 would tie (or flip) close tokens
            return dense_linear(hidden, self.lm_head, out_float=True)
        return self.lm_head(hidden).float()

    def attach_packed(self, packed: dict[str, PackedWeight]) -> None:
        """Give projections (HF weight names) quantized twins that the serving path multiplies with."""
        for name, pw in packed.items():
            module_name = name.removesuffix(".weight")
            if module_name == "model.embed_tokens":
                # only a table without dense values reads its blocks (its looked-up rows)
                if holds_no_values(self.model.embed_tokens.weight):
                    self.model.embed_tokens.packed = pw.to(self.device)
                continue
            module = self.get_submodule(module_name)
            if tuple(module.weight.shape) != (pw.out_features, pw.in_features):
                raise ValueError(f"{name}: packed shape does not match the model")
            module.packed = pw.to(self.device)
        clear_fused(self)  # the fused twins were the old weights' storage
        self._decode_stack = None  # rebuilt over the new weights on the next decode step
