"""The training forward: `Transformer.forward_dense` layer by layer, with two memory savings.

1. Layers past an activation budget are checkpointed: only their input is kept for backward and the
   layer is recomputed there, so their activation memory is one hidden state per token, not every
   intermediate (~51 KB per token per layer for SmolLM2-135M: training computes in float32).
   Recomputing costs time: a step of the bench's learning loop (4 rows of ~55 tokens on SmolLM2, one
   Zen 4 core forced to AVX2) took about twice as long checkpointed (3.4 s against 1.7 s, interleaved
   in one process), so the small batches of interactive training keep every layer's activations and
   only big ones recompute, as few layers as the budget allows.
2. Logits are computed only where a target token is trained, not over the prompt and padding:
   a [tokens, vocab] float32 tensor is the largest single allocation of a step. The last layer, whose
   outputs feed only the logits, likewise computes its queries, attention output and MLP at those
   positions only (its keys and values at every position, which those queries attend to): at 1B, with
   ~12 trained of ~54 tokens, three quarters of the layer's products in forward and backward.

It calls the model's own modules (embeddings, `DecoderLayer.forward_dense`, norm, `compute_logits`);
a parity test pins it to `forward_dense`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from kiln.model.config import ModelConfig
from kiln.model.lora import LoraDelta
from kiln.model.precision import training_dtype
from kiln.model.rope import apply_rope
from kiln.model.transformer import DecoderLayer, project

# Saved activations of all layers that are not checkpointed, at most (the rest are recomputed).
ACTIVATION_BUDGET_BYTES = 512 << 20


def saved_bytes_per_token(config: ModelConfig) -> int:
    """What one layer keeps for backward per token, rounded up: about 12 hidden-sized and 4
    intermediate-sized float32 vectors (measured 51 KB for SmolLM2-135M computing in float32)."""
    return 4 * (12 * config.hidden_size + 4 * config.intermediate_size)


def checkpointed_layers(config: ModelConfig, tokens: int, budget: int | None = None) -> int:
    """How many layers (the first ones) a forward over `tokens` padded tokens recomputes in backward
    to keep the others' saved activations within `budget` (default `ACTIVATION_BUDGET_BYTES`)."""
    budget = ACTIVATION_BUDGET_BYTES if budget is None else budget
    per_layer = max(1, tokens) * saved_bytes_per_token(config)
    return max(0, config.num_hidden_layers - budget // per_layer)


def final_hidden(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                 lora: LoraDelta | None = None, *, checkpoint_layers: bool | None = None,
                 rows: Tensor | None = None) -> Tensor:
    """Normed last hidden states `[B, T, hidden]`, as `forward_dense` computes them before the head;
    with `rows` (bool `[B, T]`) only those positions', flat `[N, hidden]` in (row, position) order, the
    last layer computing its outputs there only (`last_layer_at`).

    `checkpoint_layers`: True recomputes every layer in backward, False none; None (the default) as
    many as `ACTIVATION_BUDGET_BYTES` requires."""
    if rows is not None and not bool(rows.any()):
        # no query for the last layer: the whole forward, indexed (an empty slice, still in the graph)
        return final_hidden(model, input_ids, attention_mask, lora, checkpoint_layers=checkpoint_layers)[rows]
    b, t = input_ids.shape
    rotary = model.rotary
    rotary.ensure(t)
    if attention_mask is None:
        cos = rotary.cos[:t][None, :, None, :]
        sin = rotary.sin_signed[:t][None, :, None, :]
        mask = None
    else:
        am = attention_mask.to(device=input_ids.device, dtype=torch.bool)
        pos = (am.long().cumsum(-1) - 1).clamp_min(0)
        cos = rotary.cos[pos].unsqueeze(2)
        sin = rotary.sin_signed[pos].unsqueeze(2)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        # the diagonal stays visible so padded query rows never see an all-masked row (NaN)
        mask = (causal[None] & am[:, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
        mask = mask[:, None]
    # float32 activations on every CPU, whatever the weights' dtype (see `training_dtype`)
    h = model.embed_dense(input_ids).to(training_dtype(model.dtype, model.device))
    layers = model.model.layers
    if not torch.is_grad_enabled() or checkpoint_layers is False:
        recompute = 0
    elif checkpoint_layers is None:
        recompute = checkpointed_layers(model.config, b * t)
    else:
        recompute = len(layers)
    last = len(layers) - 1 if rows is not None else len(layers)
    for i, layer in enumerate(layers[:last]):
        if i < recompute:
            h = checkpoint(layer.forward_dense, h, cos, sin, mask, lora, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            h = layer.forward_dense(h, cos, sin, mask, lora)
    if rows is not None:
        args = (layers[last], h, cos, sin, mask, lora, rows.to(device=h.device, dtype=torch.bool))
        if last < recompute:
            h = checkpoint(last_layer_at, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            h = last_layer_at(*args)
    return model.model.norm(h)


def last_layer_at(layer: DecoderLayer, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                  lora: LoraDelta | None, rows: Tensor) -> Tensor:
    """`layer.forward_dense(h, ...)[rows]` (`rows` bool `[B, T]`; flat `[N, hidden]`), computing only
    what those outputs need: keys and values at every position, queries, attention, o_proj and the MLP
    at the chosen ones. Each query sees the keys `mask` (or causality) lets its position see in its own
    sequence, so its output is the full layer's up to rounding."""
    attn = layer.self_attn
    b, t, _ = h.shape
    li = attn.layer_idx
    x = layer.input_layernorm(h)
    q = project(attn.q_proj, x[rows], lora, li, "q_proj").view(-1, attn.num_heads, attn.head_dim)
    k = project(attn.k_proj, x, lora, li, "k_proj").view(b, t, attn.num_kv_heads, attn.head_dim)
    v = project(attn.v_proj, x, lora, li, "v_proj").view(b, t, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rope(q, cos.expand(b, t, *cos.shape[2:])[rows], sin.expand(b, t, *sin.shape[2:])[rows])
    k = apply_rope(k, cos, sin)
    # every chosen query against the keys of all B sequences, the other sequences' masked out
    seq, pos = rows.nonzero(as_tuple=True)
    keys = torch.arange(t, device=h.device)
    if mask is None:
        visible = keys[None, :] <= pos[:, None]                        # [N, T]
    else:
        visible = mask[seq, 0, pos]                                    # [N, T]
    own = seq[:, None] == torch.arange(b, device=h.device)[None, :]   # [N, B]
    allowed = (own[:, :, None] & visible[:, None, :]).reshape(-1, b * t)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.reshape(1, b * t, *k.shape[2:]).transpose(1, 2),
        v.reshape(1, b * t, *v.shape[2:]).transpose(1, 2), attn_mask=allowed[None, None], enable_gqa=True)
    out = out[0].transpose(0, 1).reshape(-1, attn.num_heads * attn.head_dim)
    hs = h[rows] + project(attn.o_proj, out, lora, li, "o_proj")
    return hs + layer.mlp(layer.post_attention_layernorm(hs), lora)


def selected_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                      target_mask: Tensor, lora: LoraDelta | None) -> Tensor:
    """log p(token t+1 | tokens <= t) at the positions `target_mask` `[B, T-1]` selects, flat `[N]` float32."""
    chosen = target_mask.bool()
    hidden = final_hidden(model, input_ids, attention_mask, lora, rows=F.pad(chosen, (0, 1)))
    logits = model.compute_logits(hidden)
    targets = input_ids[:, 1:][chosen]
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
