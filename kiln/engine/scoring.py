"""Prompt-logprob scoring for POST /v1/completions (semantics.md §5.2).

`compute_prompt_scores` runs on the engine's actor thread (it owns the model): one dense causal
forward over the prompt, then per position p >= 1 the log-softmax of logits row p-1 scores the
observed token p. Only compact results leave the actor: the observed token's logprob and full-vocab
rank, and the top-K ids with their logprobs. `prompt_logprob_entries` then decodes tokens and builds
the wire maps on the handler side.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import KilnError

# Rows of the [T, V] logits turned into log-probs at a time, bounding the extra memory.
_ROW_CHUNK = 256
# Preceding prompt tokens used as decoding context, enough to complete a split UTF-8 character
# and to keep a leading space that a token shows only after another token.
_DECODE_CONTEXT = 4


@dataclass
class PromptScores:
    """Per scored position p = 1..T-1 (list index p-1)."""

    observed_logprobs: list[float]
    observed_ranks: list[int]      # full-vocabulary rank: count of logits >= the observed token's
    top_ids: list[list[int]]       # K ids, best first, ties broken by lower id
    top_logprobs: list[list[float]]


def compute_prompt_scores(model: Any, token_ids: Sequence[int], k: int, lora: Any = None) -> PromptScores:
    """Score a prompt with `model.forward_dense` (float32 logits), plus `lora`'s deltas (a LoraDelta)
    when given. Raises KilnError(500) when a logits row is not finite or narrower than K."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        logits = model.forward_dense(ids, lora=lora)[0, :-1].float()
    n, width = logits.shape
    if k > width:
        raise KilnError(500, "generation_error", f"the model produced {width} logits per row, fewer than K={k}")
    targets = ids[0, 1:]
    out = PromptScores([], [], [], [])
    for start in range(0, n, _ROW_CHUNK):
        rows = logits[start : start + _ROW_CHUNK]
        if not torch.isfinite(rows).all():
            raise KilnError(500, "generation_error", "the model produced non-finite logits while scoring the prompt")
        logp = torch.log_softmax(rows, dim=-1)
        tgt = targets[start : start + _ROW_CHUNK].unsqueeze(1)
        observed_logit = rows.gather(1, tgt)
        out.observed_logprobs.extend(logp.gather(1, tgt).squeeze(1).tolist())
        out.observed_ranks.extend((rows >= observed_logit).sum(dim=1).tolist())
        if k == 0:
            out.top_ids.extend([] for _ in range(rows.shape[0]))
            out.top_logprobs.extend([] for _ in range(rows.shape[0]))
            continue
        vals, idx = torch.topk(logp, k, dim=-1)
        ties = (logp >= vals[:, -1:]).sum(dim=1) > k
        for r in range(rows.shape[0]):
            if bool(ties[r]):
                ids_r, vals_r = _top_k_with_ties(logp[r], float(vals[r, -1]), k)
            else:
                pairs = sorted(zip(idx[r].tolist(), vals[r].tolist(), strict=True), key=lambda p: (-p[1], p[0]))
                ids_r, vals_r = [p[0] for p in pairs], [p[1] for p in pairs]
            out.top_ids.append(ids_r)
            out.top_logprobs.append(vals_r)
    return out


def _top_k_with_ties(row: torch.Tensor, threshold: float, k: int) -> tuple[list[int], list[float]]:
    """The K best of a row whose K-th value is tied: every candidate >= the threshold, ordered by
    (logprob descending, id ascending)."""
    cand = (row >= threshold).nonzero().squeeze(1)
    pairs = sorted(zip(cand.tolist(), row[cand].tolist(), strict=True), key=lambda p: (-p[1], p[0]))[:k]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def prompt_logprob_entries(token_ids: Sequence[int], scores: PromptScores,
                           tokenizer: Any) -> list[dict[str, dict[str, Any]] | None]:
    """The wire `prompt_logprobs`: null first, then per position the observed token (rank = its place
    in the top-K when there, else its full-vocabulary rank) plus the top-K ranked by position; keys are
    decimal ids in string order."""
    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for p in range(1, len(token_ids)):
        i = p - 1
        context = list(token_ids[max(0, p - _DECODE_CONTEXT) : p])
        observed = token_ids[p]
        wanted: dict[int, tuple[float, int]] = {}
        for rank, (tid, lp) in enumerate(zip(scores.top_ids[i], scores.top_logprobs[i], strict=True), 1):
            wanted[tid] = (lp, rank)
        if observed not in wanted:
            wanted[observed] = (scores.observed_logprobs[i], scores.observed_ranks[i])
        texts = _decode_in_context(tokenizer, context, list(wanted))
        entry = {
            str(tid): {"logprob": lp, "rank": rank, "decoded_token": texts[tid]}
            for tid, (lp, rank) in wanted.items()
        }
        entries.append(dict(sorted(entry.items())))
    return entries


def _decode_in_context(tokenizer: Any, context: list[int], candidates: list[int]) -> dict[int, str]:
    """Each candidate's text as it reads after `context`: what decode(context + [t]) adds to decode(context).

    Taken past the common prefix of the two strings, so a candidate that completes a UTF-8 character
    the context left open (decoded as U+FFFD) returns the whole character.
    """
    try:
        prefix = tokenizer.decode(context) if context else ""
        backend = getattr(tokenizer, "backend", None)
        seqs = [context + [t] for t in candidates]
        if backend is not None:
            full = backend.decode_batch(seqs, skip_special_tokens=False)
        else:
            full = [tokenizer.decode(s) for s in seqs]
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is the same client-visible error
        raise KilnError(500, "tokenization_error", f"could not decode prompt tokens: {e}") from None
    return {t: text[len(os.path.commonprefix([prefix, text])):] for t, text in zip(candidates, full, strict=True)}
