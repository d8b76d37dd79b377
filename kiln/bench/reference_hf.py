"""Reference: Hugging Face `transformers` generate on the same weights (GGUF dequantized to float32).

It has no server, so "N concurrent streams" would be N generate calls one after another: `kiln bench
--transformers` measures it single-stream only (`single_only`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.bench.client_load import LoadRun
from kiln.bench.engines import BenchEngine, SingleRun
from kiln.bench.prompts import BenchPrompt
from kiln.bench.results import TRANSFORMERS


class _TokenClock:
    """A generate() streamer that only notes when each new token is produced."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:   # generate() first hands the streamer the prompt itself
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(model_path: str, threads: int) -> Any:
    # Progress bars (its GGUF conversion uses tqdm directly) would interleave with the report; tqdm reads
    # TQDM_DISABLE when it is first imported, so set it before transformers pulls tqdm in.
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


class TransformersEngine(BenchEngine):
    name = TRANSFORMERS
    single_only = True

    def __init__(self, model_path: str, threads: int) -> None:
        self.model_path, self.threads = model_path, threads
        self.model: Any = None

    def start(self) -> None:
        self.model = load_hf_model(self.model_path, self.threads)

    def close(self) -> None:
        self.model = None

    def _generate(self, prompt: BenchPrompt, max_tokens: int) -> tuple[float, list[float]]:
        import torch

        ids = torch.tensor([prompt.prompt_ids], dtype=torch.long)
        eos = self.model.config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            # min_new_tokens == max_new_tokens is generate()'s ignore_eos; greedy == temperature 0.
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, streamer=clock,
                                pad_token_id=pad)
        return start, clock.times

    def single(self, prompt: BenchPrompt, max_tokens: int) -> SingleRun:
        start, times = self._generate(prompt, max_tokens)
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return SingleRun(prompt_tokens=prompt.num_tokens, ttft_s=times[0] - start, completion_tokens=len(times),
                         decode_tps=(len(times) - 1) / span if span > 0 else None)

    def load(self, prompts: Sequence[BenchPrompt], concurrency: int, max_tokens: int) -> LoadRun:
        t0 = time.perf_counter()
        latencies, tokens = [], 0
        for prompt in prompts:
            _, times = self._generate(prompt, max_tokens)
            latencies.append(times[-1] - t0)
            tokens += len(times)
        return LoadRun(concurrency=concurrency, wall_s=time.perf_counter() - t0, latencies_s=latencies,
                       completion_tokens=tokens)
