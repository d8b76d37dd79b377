"""The training forward: `Transformer.forward_dense` layer by layer, with two memory savings.

1. Each decoder layer is checkpointed: only its input is kept for backward and the layer is recomputed
   there, so activation memory is one hidden state per token per layer plus one layer's worth, not
   every intermediate of every layer (~40 KB per token per layer for SmolLM2-135M in bfloat16).
2. Logits are computed only where a target token is trained, not over the prompt and padding:
   a [tokens, vocab] float32 tensor is the largest single allocation of a step.

It calls the model's own modules (embeddings, `DecoderLayer.forward_dense`, norm, `compute_logits`);
a parity test pins it to `forward_dense`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from kiln.model.lora import LoraDelta


def final_hidden(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                 lora: LoraDelta | None = None, *, checkpoint_layers: bool = True) -> Tensor:
    """Normed last hidden states `[B, T, hidden]`, as `forward_dense` computes them before the head."""
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
    h = model.embed_dense(input_ids)   # float32 where the CPU would emulate bfloat16 matmuls
    recompute = checkpoint_layers and torch.is_grad_enabled()
    for layer in model.model.layers:
        if recompute:
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
