"""The paged serving path gives the dense path's logits, alone or batched with other sequences."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model import transformer as transformer_module
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import load_model
from kiln.model.transformer import Transformer

from .conftest import TinyModel

BLOCK = 4


@pytest.fixture(autouse=True, params=["kernels", "kernels, chunks split", "kernels, chunks on torch", "torch"])
def serving_ops(request, monkeypatch):
    """Every paged test runs on the C++ decode ops (norm, paged attention), with prompt chunks on the
    kernels' attention, split between the kernel (a prompt's first 6 positions) and torch's SDPA, and
    on torch's alone (whichever ISA the CPU runs), and on the torch ops alone."""
    if request.param.startswith("kernels"):
        if kernels.load() is None:
            pytest.skip(f"kernels unavailable: {kernels.load_error()}")
        positions = {"kernels": 1 << 62, "kernels, chunks split": 6, "kernels, chunks on torch": 0}[request.param]
        monkeypatch.setattr(kernels, "chunk_attention_kernel_positions", lambda: positions)
    else:
        monkeypatch.setattr(transformer_module, "cpu_kernels", lambda x: None)
    return request.param


def _step(model: Transformer, cache: KVCache, items: list[tuple[list[int], list[int], int]]) -> list[torch.Tensor]:
    """items: (block_table, all token ids so far, num_computed); feeds the uncomputed tail of each.
    Returns float32 logits per item for the tokens fed."""
    meta, positions = build_attention_metadata(
        [(table, computed, len(ids) - computed) for table, ids, computed in items], BLOCK, "cpu"
    )
    flat = [t for _, ids, computed in items for t in ids[computed:]]
    hidden = model(torch.tensor(flat), torch.tensor(positions), meta, cache)
    logits = model.compute_logits(hidden)
    out, start = [], 0
    for _, ids, computed in items:
        n = len(ids) - computed
        out.append(logits[start : start + n])
        start += n
    return out


def test_chunked_prefill_then_decode_matches_dense(tiny: TinyModel) -> None:
    model = tiny.ours
    ids = torch.randint(0, 96, (25,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        dense = model.forward_dense(torch.tensor([ids]))[0]
    cache = KVCache(model.config, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    table = [9, 3, 14, 0, 7, 11, 2]  # deliberately scattered blocks
    got = _step(model, cache, [(table, ids[:11], 0)])
    got += _step(model, cache, [(table, ids[:20], 11)])
    for n in range(21, 26):
        got += _step(model, cache, [(table, ids[:n], n - 1)])
    torch.testing.assert_close(torch.cat(got), dense, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_each_sequence_alone(tiny: TinyModel) -> None:
    model = tiny.ours
    gen = torch.Generator().manual_seed(6)
    a = torch.randint(0, 96, (9,), generator=gen).tolist()
    b = torch.randint(0, 96, (14,), generator=gen).tolist()
    c = torch.randint(0, 96, (13,), generator=gen).tolist()
    tables = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}

    def prime(cache: KVCache) -> None:
        # a and b computed up to their last token; c has a 6-token chunk already computed
        _step(model, cache, [(tables["a"], a[:-1], 0)])
        _step(model, cache, [(tables["b"], b[:-1], 0)])
        _step(model, cache, [(tables["c"], c[:6], 0)])

    batched_cache = KVCache(model.config, 12, BLOCK, torch.float32, "cpu")
    prime(batched_cache)
    batched = _step(
        model,
        batched_cache,
        [(tables["a"], a, len(a) - 1), (tables["b"], b, len(b) - 1), (tables["c"], c, 6)],
    )
    alone_cache = KVCache(model.config, 12, BLOCK, torch.float32, "cpu")
    prime(alone_cache)
    alone = [
        _step(model, alone_cache, [(tables["a"], a, len(a) - 1)])[0],
        _step(model, alone_cache, [(tables["b"], b, len(b) - 1)])[0],
        _step(model, alone_cache, [(tables["c"], c, 6)])[0],
    ]
    for got, want in zip(batched, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched_cache.storage, alone_cache.storage)


def test_two_fresh_prefills_in_one_step_match_dense(tiny_llama: TinyModel) -> None:
    model = tiny_llama.ours
    gen = torch.Generator().manual_seed(7)
    a = torch.randint(0, 96, (7,), generator=gen).tolist()
    b = torch.randint(0, 96, (10,), generator=gen).tolist()
    cache = KVCache(model.config, 8, BLOCK, torch.float32, "cpu")
    got = _step(model, cache, [([0, 1], a, 0), ([2, 3, 4], b, 0)])
    with torch.no_grad():
        torch.testing.assert_close(got[0], model.forward_dense(torch.tensor([a]))[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], model.forward_dense(torch.tensor([b]))[0], atol=1e-5, rtol=1e-5)


def test_metadata_maps_positions_to_block_slots() -> None:
    meta, positions = build_attention_metadata([([7], 2, 1), ([5, 2], 3, 3)], 4, "cpu")
    assert positions == [2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert meta.num_decode_tokens == 1
    assert meta.decode_context_slots.tolist() == [[28, 29, 30]]
    assert meta.decode_context_lens.tolist() == [3]
    (chunk,) = meta.prefills
    assert (chunk.query_start, chunk.query_len) == (1, 3)
    assert chunk.context_slots.tolist() == [20, 21, 22, 23, 8, 9]


def test_metadata_pads_decode_contexts_to_the_longest() -> None:
    meta, _ = build_attention_metadata([([0], 0, 1), ([1, 2], 5, 1)], 4, "cpu")
    assert meta.decode_context_slots.shape == (2, 6)
    assert meta.decode_context_lens.tolist() == [1, 6]
    assert meta.decode_context_slots[1].tolist() == [4, 5, 6, 7, 8, 9]
    assert meta.prefills == []


def test_kv_cache_bytes_per_block_counts_k_and_v_of_every_layer(tiny_llama: TinyModel) -> None:
    cfg = tiny_llama.ours.config
    per_block = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    assert per_block == 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 2
    cache = KVCache(cfg, 3, 16, "bfloat16", "cpu")
    assert cache.storage.numel() * cache.storage.element_size() == 3 * per_block
    assert cache.k[0].shape == (48, cfg.num_key_value_heads, cfg.head_dim)


def test_bfloat16_paged_path_tracks_the_dense_path(tiny_llama: TinyModel) -> None:
    model, _ = load_model(tiny_llama.path, dtype="bfloat16")
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    cache = KVCache(model.config, 4, BLOCK, model.dtype, "cpu")
    got = _step(model, cache, [([0, 1, 2], ids[:8], 0)])
    got += _step(model, cache, [([0, 1, 2], ids, 8)])
    with torch.no_grad():
        dense = model.forward_dense(torch.tensor([ids]))[0]
    assert torch.cat(got).dtype == torch.float32
    torch.testing.assert_close(torch.cat(got), dense, atol=0.05, rtol=0.05)


def test_a_prompts_logits_do_not_depend_on_how_it_was_chunked(tiny: TinyModel) -> None:
    """Chunks of 4, 7 and 14 queries (the first two straddling the split's line at position 6) give
    what the whole prompt in one chunk gives. (The tiny models' projections are torch's, whose sums
    depend on the row count, so within a rounding, not bit for bit.)"""
    model = tiny.ours
    ids = torch.randint(0, 96, (25,), generator=torch.Generator().manual_seed(8)).tolist()
    table = [9, 3, 14, 0, 7, 11, 2]
    whole_cache = KVCache(model.config, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    split_cache = KVCache(model.config, num_blocks=16, block_size=BLOCK, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        whole = _step(model, whole_cache, [(table, ids, 0)])[0]
        split = torch.cat(_step(model, split_cache, [(table, ids[:4], 0)])
                          + _step(model, split_cache, [(table, ids[:11], 4)])
                          + _step(model, split_cache, [(table, ids, 11)]))
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split_cache.storage, whole_cache.storage, atol=1e-5, rtol=1e-5)


def _some_rows_and_the_whole_step(model: Transformer) -> tuple[torch.Tensor, torch.Tensor, KVCache, KVCache]:
    """A mixed step (two decodes, a 13-token prompt) run whole and asked for its sampled rows only."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randint(0, 96, (9,), generator=gen).tolist()
    b = torch.randint(0, 96, (6,), generator=gen).tolist()
    c = torch.randint(0, 96, (13,), generator=gen).tolist()
    tables = {"a": [1, 2, 3], "b": [4, 5], "c": [8, 9, 10, 11]}

    def run(out_rows: list[int] | None) -> tuple[torch.Tensor, KVCache]:
        cache = KVCache(model.config, 12, BLOCK, model.dtype, "cpu")
        _step(model, cache, [(tables["a"], a[:-1], 0)])
        _step(model, cache, [(tables["b"], b[:-1], 0)])
        meta, positions = build_attention_metadata(
            [(tables["a"], len(a) - 1, 1), (tables["b"], len(b) - 1, 1), (tables["c"], 0, len(c))], BLOCK, "cpu")
        flat = [a[-1], b[-1], *c]
        with torch.inference_mode():
            hidden = model(torch.tensor(flat), torch.tensor(positions), meta, cache, out_rows=out_rows)
        return hidden, cache

    whole, whole_cache = run(None)
    some, some_cache = run([0, 1, 2 + len(c) - 1])
    return some, whole[[0, 1, 2 + len(c) - 1]], some_cache, whole_cache


def test_a_step_asked_for_its_sampled_rows_gives_those_rows_and_fills_the_same_cache(tiny: TinyModel) -> None:
    # the last layer runs past its K/V for those rows alone (torch's float32 matmul may round a
    # smaller batch differently: the kernels' paths are bit for bit, tests/model/test_quant_model.py)
    some, want, some_cache, whole_cache = _some_rows_and_the_whole_step(tiny.ours)
    assert some.shape == want.shape == (3, tiny.ours.config.hidden_size)
    torch.testing.assert_close(some, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(some_cache.storage, whole_cache.storage)
