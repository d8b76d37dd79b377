"""ModelRunner: owns the model and the KV tensors, and turns one scheduled step into sampled tokens.

Rows under an output grammar get their token masks computed in one llguidance call on a helper thread
while the model runs (llguidance releases the GIL), then applied after the penalties (kiln.model.sampler).

Each step is timed in three parts (model forward, sampling, host readback) for the latency
diagnostics; on CUDA the parts are measured with events, so timing adds no synchronization.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kiln.core.scheduler import SchedulerOutput
from kiln.core.sequence import Sequence
from kiln.engine.grammar import GrammarCounters, MaskBuilder
from kiln.engine.scoring import PromptScores, compute_prompt_scores
from kiln.engine.timing import StepTiming
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.lora import DenseRouting, build_lora_step
from kiln.model.quant import holds_no_values
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
        self.kv_dtype = kv_dtype
        self.kv_cache = KVCache(model.config, num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}
        self.grammar_counters = GrammarCounters()
        self._masks = MaskBuilder(model.config.vocab_size, self.grammar_counters)
        self._mask_thread: ThreadPoolExecutor | None = None

    @property
    def backend(self) -> str:
        """The generation backend name (rollout provenance `generation_backend`, /health `backend`)."""
        return f"kiln-torch-{self.device.type}"

    @property
    def kv_cache_bytes(self) -> int:
        return KVCache.bytes_per_block(self.model.config, self.block_size, self.kv_dtype) * self.num_blocks

    @property
    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

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

    def warmup(self) -> None:
        """One tiny forward, so the first request does not pay for lazy kernel set-up: through the
        serving path (two tokens into KV block 0, free before the first request and overwritten by
        whichever sequence takes it) where weights are held only as quantized blocks, since the dense
        path would dequantize every projection and the LM head (at 1B: ~5 s of CPU, a ~240 MB
        transient and a 32 MB per-thread buffer kept for good) for a path serving never takes."""
        with torch.inference_mode():
            if not any(holds_no_values(p) for p in self.model.parameters()):
                self.model.forward_dense(torch.zeros((1, 2), dtype=torch.long, device=self.device))
                return
            attn, positions = build_attention_metadata([([0], 0, 2)], self.block_size, self.device)
            ids = torch.zeros(2, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            lora = build_lora_step([0], [2], attn.num_decode_tokens, self.device)
            self.model(ids, pos, attn, self.kv_cache, lora, out_rows=[1], logits=True)

    def score(self, token_ids: list[int], top_k: int, lora_slot: int = 0) -> PromptScores:
        """Prompt log-probs (POST /v1/completions, /compat/v1/completions); the caller is the actor
        thread, which has pinned `lora_slot` (0: the base model) in the model's LoRA bank."""
        lora = None
        if lora_slot and self.model.lora_bank is not None:
            lora = DenseRouting(self.model.lora_bank, build_lora_step([lora_slot], [len(token_ids)], 0, self.device))
        return compute_prompt_scores(self.model, token_ids, top_k, lora)

    @torch.inference_mode()
    def step(self, out: SchedulerOutput, launched: Callable[[], None] | None = None
             ) -> tuple[dict[int, StepResult], StepTiming]:
        """Sampled tokens by seq id, and how long the step's parts took. `launched` runs once the inputs
        are built, as the model's layers start (the actor hands the last step's events over then)."""
        if not out.items:
            return {}, StepTiming(0.0, 0.0, 0.0)
        clock = _StepClock(self.device)
        # prompt chunks (first prefill or a preempted sequence's recompute) make this a prefill step
        had_prefill = any(it.is_prefill for it in out.items)
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
        lora = build_lora_step([it.seq.lora_slot for it in out.items], [it.num_new_tokens for it in out.items],
                               attn.num_decode_tokens, self.device)
        rows: list[int] = []
        sampled_items = []
        offset = 0
        for item in out.items:
            offset += item.num_new_tokens
            if item.sample:
                rows.append(offset - 1)
                sampled_items.append(item)
        seqs = [it.seq for it in sampled_items]
        masks = self._start_masks(seqs)
        # the model computes past the last layer's K/V only the rows that sample, and their logits
        logits = self.model(ids_t, pos_t, attn, self.kv_cache, lora, launched=launched, out_rows=rows,
                            logits=bool(rows))
        if not rows:
            (forward_ms,) = clock.finish()
            return {}, StepTiming(forward_ms, 0.0, 0.0, had_prefill)
        clock.mark()
        token_masks = None
        if masks is not None:
            mask_rows, future = masks
            token_masks = (mask_rows, future.result())
        tokens, logprobs = self.sampler(
            logits,
            [s.params for s in seqs],
            [s.output_token_ids for s in seqs],
            [self.generator_for(s) for s in seqs],
            token_masks,
        )
        clock.mark()
        tokens_l = tokens.tolist()
        logprobs_l = logprobs.tolist()
        forward_ms, sampling_ms, readback_ms = clock.finish()
        results = {s.seq_id: StepResult(t, lp) for s, t, lp in zip(seqs, tokens_l, logprobs_l, strict=True)}
        return results, StepTiming(forward_ms, sampling_ms, readback_ms, had_prefill)


    def _start_masks(self, seqs: list[Sequence]) -> tuple[list[int], Future] | None:
        """The constrained rows and their masks being computed beside the forward, or None."""
        rows = [r for r, s in enumerate(seqs) if s.grammar is not None and s.grammar.wants_mask]
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        states = [seqs[r].grammar for r in rows]
        return rows, self._mask_thread.submit(self._masks.fill, states)


class _StepClock:
    """Consecutive intervals of one step: perf_counter on CPU; CUDA events on a GPU (device time),
    read only after the step's own readback has synchronized the stream."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def finish(self) -> tuple[float, ...]:
        self.mark()
        if self.cuda:
            self.marks[-1].synchronize()
            return tuple(a.elapsed_time(b) for a, b in itertools.pairwise(self.marks))
        return tuple((b - a) * 1000.0 for a, b in itertools.pairwise(self.marks))
