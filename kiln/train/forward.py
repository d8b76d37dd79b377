"""The training forward: `Transformer.forward_dense` layer by layer, with two memory savings.

1. Layers past an activation budget are checkpointed: only their input is kept for backward and the
   layer is recomputed there, so their activation memory is one hidden state per token, not every
   intermediate (~51 KB per token per layer for SmolLM2-135M: training computes in float32).
   Recomputing costs time: a step of the bench's learning loop (4 rows of ~55 tokens on SmolLM2, one
   Zen 4 core forced to AVX2) took about twice as long checkpointed (3.4 s against 1.7 s, interleaved
   in one process), so the small batches of interactive training keep every layer's activations and
   only big ones recompute, as few layers as the budget allows.
2. Logits are computed only where a target token is trained, not over the prompt and padding:
   a [tokens, vocab] float32 tensor is the largest single allocation of a step.

It calls the model's own modules (embeddings, `DecoderLayer.forward_dense`, norm, `compute_logits`);
a parity test pins it to `forward_dense`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from kiln.model.config import ModelConfig
from kiln.model.lora import LoraDelta
from kiln.model.precision import training_dtype

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
                 lora: LoraDelta | None = None, *, checkpoint_layers: bool | None = None) -> Tensor:
    """Normed last hidden states `[B, T, hidden]`, as `forward_dense` computes them before the head.

    `checkpoint_layers`: True recomputes every layer in backward, False none; None (the default) as
    many as `ACTIVATION_BUDGET_BYTES` requires."""
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
    for i, layer in enumerate(layers):
        if i < recompute:
            h = checkpoint(layer.forward_dense, h, cos, sin, mask, lora, use_reentrant=False,
                           preserve_rng_state=False)
        else:
            h = layer.forward_dense(h, cos, sin, mask, lora)
    return model.model.norm(h)


def selected_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                      target_mask: Tensor, lora: LoraDelta | None) -> Tensor:
    """log p(token t+1 | tokens <= t) at the positions `target_mask` `[B, T-1]` selects, flat `[N]` float32."""
    hidden = final_hidden(model, input_ids, attention_mask, lora)[:, :-1]
    chosen = target_mask.bool()
    logits = model.compute_logits(hidden[chosen])
    targets = input_ids[:, 1:][chosen]
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
