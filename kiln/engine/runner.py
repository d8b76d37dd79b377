"""ModelRunner: owns the model and the KV tensors, and turns one scheduled step into sampled tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kiln.core.scheduler import SchedulerOutput
from kiln.core.sequence import Sequence
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.sampler import Sampler
from kiln.model.transformer import Transformer

log = logging.getLogger("kiln.engine")


@dataclass
class StepResult:
    token_id: int
    logprob: float | None
    forced: bool = False


class ModelRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, device: torch.device,
                 kv_dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(model.config, num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            # Sampling happens on CPU-side logits copies only when the device is CPU; a CUDA generator
            # must live on the logits' device.
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seq.params.seed or 0) & (2**64 - 1))
            self._generators[seq.seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def step(self, out: SchedulerOutput) -> dict[int, StepResult]:
        if not out.items:
            return {}
        input_ids: list[int] = []
        meta_items = []
        for item in out.items:
            seq = item.seq
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids[start : start + item.num_new_tokens]
            input_ids.extend(tokens)
            meta_items.append((seq.block_table, start, item.num_new_tokens))
        attn, positions = build_attention_metadata(meta_items, self.block_size, self.device)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, attn, self.kv_cache)

        rows: list[int] = []
        sampled_items = []
        offset = 0
        for item in out.items:
            offset += item.num_new_tokens
            if item.sample:
                rows.append(offset - 1)
                sampled_items.append(item)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        seqs = [it.seq for it in sampled_items]
        tokens, logprobs = self.sampler(
            logits,
            [s.params for s in seqs],
            [s.output_token_ids for s in seqs],
            [self.generator_for(s) for s in seqs],
        )
        tokens_l = tokens.tolist()
        logprobs_l = logprobs.tolist()
        return {s.seq_id: StepResult(t, lp) for s, t, lp in zip(seqs, tokens_l, logprobs_l, strict=True)}
