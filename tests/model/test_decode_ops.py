"""The fused decode ops (kernels/decode_ops.cpp) against torch's own norm and attention; attention on
every ISA the CPU runs (`each_isa`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kiln.model import kernels

pytestmark = pytest.mark.skipif(kernels.load() is None, reason=f"kernels unavailable: {kernels.load_error()}")


@pytest.mark.parametrize("n", [576, 37, 1])
def test_rms_norm_matches_torch_in_float32(each_isa, n):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(5, n, generator=g), torch.randn(n, generator=g)
    got = kernels.load().rms_norm(x, w, 1e-5)
    assert torch.allclose(got, F.rms_norm(x, (n,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_rms_norm_rounds_bfloat16_like_torch_within_one_ulp(each_isa):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()
    got, ref = kernels.load().rms_norm(x, w, 1e-6), F.rms_norm(x, (576,), w, 1e-6)
    assert got.dtype == torch.bfloat16
    # the normalised row is rounded to bfloat16 before the weight multiplies it, as F.rms_norm does
    assert torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=0)


def test_rms_norm_reads_strided_rows(each_isa):
    x = torch.randn(3, 64)
    w = torch.randn(32)
    view = x[:, :32]   # row stride 64
    assert torch.allclose(kernels.load().rms_norm(view, w, 1e-5), F.rms_norm(view, (32,), w, 1e-5), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 100, 37, 16, 8, 1])
def test_rms_norm_has_the_same_bits_on_every_isa(dtype, n):
    # the vector path sums squares in the scalar path's 16 partial sums and tree
    g = torch.Generator().manual_seed(n)
    x, w = (torch.randn(7, n, generator=g) * 3).to(dtype), torch.randn(n, generator=g).to(dtype)
    outs = []
    for isa in kernels.cpu_isas():
        with kernels.using_isa(isa):
            outs.append(kernels.load().rms_norm(x, w, 1e-5))
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_rows_norm_does_not_depend_on_its_batch(each_isa):
    x, w = torch.randn(64, 576).bfloat16(), torch.randn(576).bfloat16()
    module = kernels.load()
    batched = module.rms_norm(x, w, 1e-5)
    assert torch.equal(torch.cat([module.rms_norm(x[i:i + 1], w, 1e-5) for i in range(64)]), batched)


def _reference(q, k_cache, v_cache, slots, lens):
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        ck = k_cache[slots[b, :n]].transpose(0, 1).float()
        cv = v_cache[slots[b, :n]].transpose(0, 1).float()
        qg = q[b].float().view(hkv, -1, d)
        rows.append(F.scaled_dot_product_attention(qg, ck, cv).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (8, 1, 8), (2, 2, 272)])
def test_paged_attention_matches_sdpa_over_each_decode_context(each_isa, dtype, tol, heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads * d)
    k_cache = torch.randn(300, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(300, kv_heads, d, generator=g).to(dtype)
    slots = torch.randint(0, 300, (4, 120), generator=g)
    lens = torch.tensor([120, 33, 1, 64])     # padding past each length must be ignored
    q = torch.randn(4, heads, d, generator=g).to(dtype)
    got = kernels.load().paged_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert got.shape == (4, heads * d) and got.dtype == dtype
    assert torch.allclose(got.float(), _reference(q, k_cache, v_cache, slots, lens), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_attention_over_a_prefix_is_causal_within_the_chunk(each_isa, dtype, tol):
    g = torch.Generator().manual_seed(11)
    k_cache = torch.randn(64, 2, 32, generator=g).to(dtype)
    v_cache = torch.randn(64, 2, 32, generator=g).to(dtype)
    context = torch.randperm(64, generator=g)[:40]   # 30 cached positions, then a 10-token chunk
    q = torch.randn(10, 6, 32, generator=g).to(dtype)
    lens = torch.arange(31, 41)
    slots = context.expand(10, 40).contiguous()   # the chunk's tokens share one sequence's slot row
    got = kernels.load().paged_attention(q, k_cache, v_cache, slots, lens, 32 ** -0.5)
    want = _reference(q, k_cache, v_cache, slots, lens)
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)


def test_paged_attention_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels.load().paged_attention(torch.randn(2, 4, 8), torch.randn(10, 3, 8), torch.randn(10, 3, 8),
                                       torch.zeros(2, 5, dtype=torch.long), torch.ones(2, dtype=torch.long), 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_and_cache_rotates_q_and_k_like_apply_rope_and_stores_k_and_v(dtype, tol):
    from kiln.model.rope import apply_rope

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, h, 16, generator=g).to(dtype) for h in (6, 2, 2))
    cos = torch.randn(3, 1, 16, generator=g).to(dtype)
    sin = torch.randn(3, 1, 16, generator=g).to(dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = torch.zeros(10, 2, 16, dtype=dtype), torch.zeros(10, 2, 16, dtype=dtype)
    slots = torch.tensor([7, 2, 9])
    kernels.load().rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.allclose(q.float(), want_q.float(), atol=tol, rtol=tol)
    assert torch.allclose(k.float(), want_k.float(), atol=tol, rtol=tol)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    assert k_cache[[0, 1, 3, 4, 5, 6, 8]].abs().sum() == 0


def test_rope_and_cache_works_on_views_of_one_fused_qkv_output():
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(3, (6 + 2 + 2) * 16, generator=g).to(torch.bfloat16)
    cos = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    sin = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16)
    q, k, v = (t.contiguous().view(3, -1, 16) for t in qkv.split([96, 32, 32], dim=1))
    caches = [torch.zeros(10, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([7, 2, 9])
    kernels.load().rope_and_cache(q, k, v, cos, sin, caches[0], caches[1], slots)
    views = [t.view(3, -1, 16) for t in qkv.split([96, 32, 32], dim=1)]
    kernels.load().rope_and_cache(*views, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(views[0], q) and torch.equal(views[1], k)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_inplace_rounds_like_torch_add(dtype):
    g = torch.Generator().manual_seed(7)
    h, d = torch.randn(4, 576, generator=g).to(dtype), torch.randn(4, 576, generator=g).to(dtype)
    want = h + d
    kernels.load().add_inplace(h, d)
    assert torch.equal(h, want)


def test_rope_and_cache_refuses_a_slot_outside_the_cache():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    cos, sin = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    with pytest.raises(ValueError, match="out of range"):
        kernels.load().rope_and_cache(q, k, v, cos, sin, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), torch.tensor([3]))


def _block_slots(tokens: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Slot rows of 16-position blocks scattered over a cache, as the block tables lay them out."""
    blocks = (length + 15) // 16
    order = torch.randperm(tokens * blocks + 3, generator=generator)
    rows = [(order[t * blocks:(t + 1) * blocks, None] * 16 + torch.arange(16)).reshape(-1) for t in range(tokens)]
    return torch.stack(rows), (tokens * blocks + 3) * 16


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 128), (6, 3, 48), (4, 4, 16), (4, 2, 8)])
def test_paged_attention_over_long_contexts_matches_sdpa(each_isa, dtype, tol, heads, kv_heads, d):
    # long contexts run as several splits whose partial softmaxes are combined; 700 and 513 end
    # inside a block, 64 and 49 are a single split, 1 a single position
    g = torch.Generator().manual_seed(700 + d)
    lens = torch.tensor([700, 513, 64, 49, 1])
    slots, n = _block_slots(5, 700, g)
    k_cache = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    q = torch.randn(5, heads, d, generator=g).to(dtype)
    got = kernels.load().paged_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), _reference(q, k_cache, v_cache, slots, lens), atol=tol, rtol=tol)


@pytest.mark.parametrize("d", [64, 8])
def test_split_contexts_combine_sharp_softmaxes_exactly_enough(each_isa, d):
    # large scores: each split's maximum differs by far, so the combination must rescale the splits'
    # sums and outputs by exp(m_split - m) to agree with one softmax over the whole context
    g = torch.Generator().manual_seed(d)
    slots, n = _block_slots(3, 1100, g)
    k_cache, v_cache = torch.randn(n, 2, d, generator=g), torch.randn(n, 2, d, generator=g)
    q = 6 * torch.randn(3, 4, d, generator=g)
    lens = torch.tensor([1100, 777, 300])
    got = kernels.load().paged_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    assert torch.allclose(got, _reference(q, k_cache, v_cache, slots, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_attention_does_not_depend_on_its_batch_or_the_thread_count(each_isa, dtype):
    g = torch.Generator().manual_seed(3)
    slots, n = _block_slots(6, 640, g)
    k_cache = torch.randn(n, 3, 64, generator=g).to(dtype)
    v_cache = torch.randn(n, 3, 64, generator=g).to(dtype)
    q = torch.randn(6, 9, 64, generator=g).to(dtype)
    lens = torch.tensor([600, 640, 17, 0, 300, 129])
    op = kernels.load().paged_attention
    batch = op(q, k_cache, v_cache, slots, lens, 0.125)
    assert torch.equal(batch, op(q, k_cache, v_cache, slots, lens, 0.125))
    assert batch[3].abs().sum() == 0   # no context: zeros
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for t in range(6):
                alone = op(q[t:t + 1], k_cache, v_cache, slots[t:t + 1], lens[t:t + 1], 0.125)
                assert torch.equal(alone[0], batch[t]), (n_threads, t)
            # a shorter slot table (padding cut) and the token in another row change nothing either
            pair = op(q[[4, 0]], k_cache, v_cache, slots[[4, 0], :600].contiguous(), lens[[4, 0]], 0.125)
            assert torch.equal(pair[0], batch[4]) and torch.equal(pair[1], batch[0])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_chunks_tokens_share_one_slot_row_and_each_gets_its_decode_bits(each_isa, dtype):
    g = torch.Generator().manual_seed(4)
    row, n = _block_slots(1, 700, g)
    row = row[:, :700]
    k_cache = torch.randn(n, 3, 64, generator=g).to(dtype)
    v_cache = torch.randn(n, 3, 64, generator=g).to(dtype)
    q = torch.randn(40, 9, 64, generator=g).to(dtype)
    lens = torch.arange(661, 701)          # a 40-token chunk over 660 cached positions: causal
    op = kernels.load().paged_attention
    chunk = op(q, k_cache, v_cache, row.expand(40, 700), lens, 0.125)   # one row, stride 0: no copy
    assert torch.equal(chunk, op(q, k_cache, v_cache, row.expand(40, 700).contiguous(), lens, 0.125))
    for t in (0, 17, 39):                  # each token alone, as a decode step would read it
        alone = op(q[t:t + 1], k_cache, v_cache, row[:, :int(lens[t])].contiguous(), lens[t:t + 1], 0.125)
        assert torch.equal(alone[0], chunk[t]), t
    # the first 25 tokens as a chunk of their own: a token's bits do not depend on its chunk
    assert torch.equal(op(q[:25], k_cache, v_cache, row.expand(25, 700), lens[:25], 0.125), chunk[:25])


# ---- greedy_pick: the sampler's greedy rows ----

def test_greedy_pick_takes_each_rows_argmax_with_its_log_softmax(each_isa):
    torch.manual_seed(0)
    logits = torch.randn(5, 1000 + 7) * 6   # a tail past the last whole vector
    tokens, logprobs = kernels.load().greedy_pick(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    want = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, want, rtol=1e-5, atol=1e-6)


def test_greedy_pick_row_is_the_same_alone_or_batched(each_isa):
    torch.manual_seed(1)
    logits = torch.randn(9, 49152) * 4
    tokens, logprobs = kernels.load().greedy_pick(logits)
    for r in (0, 4, 8):
        t, lp = kernels.load().greedy_pick(logits[r:r + 1].clone())
        assert t.item() == tokens[r].item()
        assert lp.view(torch.int32).item() == logprobs[r:r + 1].view(torch.int32).item()


def test_greedy_pick_takes_the_first_of_tied_maxima_and_reads_strided_rows(each_isa):
    logits = torch.zeros(3, 64)
    logits[:, [10, 40]] = 2.0
    tokens, _ = kernels.load().greedy_pick(logits[::2])
    assert tokens.tolist() == [10, 10]


def test_greedy_pick_of_a_row_with_nan_is_its_first_nan_and_a_nan_log_prob(each_isa):
    logits = torch.tensor([[1.0, float("nan"), 3.0, float("nan")] + [0.0] * 20])
    tokens, logprobs = kernels.load().greedy_pick(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [1]
    assert math.isnan(logprobs.item())
