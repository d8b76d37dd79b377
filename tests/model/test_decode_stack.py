"""The C++ DecodeStack (all layers of a step whose tokens attend on the kernel, in one call) computes
exactly what the layer-by-layer path computes, so a sequence's tokens never depend on which path
carried a step."""

from __future__ import annotations

import pytest
import torch

from kiln.model import kernels
from kiln.model import transformer as transformer_module
from kiln.model.decode_stack import build_decode_stack, clear_fused
from kiln.model.kv_cache import KVCache, build_attention_metadata
from kiln.model.loader import load_model
from kiln.model.lora import MODULES, LoraBank, build_lora_step, module_shapes
from kiln.model.transformer import Transformer

from .conftest import make_hf

BLOCK = 4
TABLES = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]


@pytest.fixture(autouse=True)
def _kernels():
    if kernels.load() is None:
        pytest.skip(f"kernels unavailable: {kernels.load_error()}")


def _packed(tmp_path, kind: str, quantization: str = "q4_1", dtype: str = "bfloat16") -> Transformer:
    path = tmp_path / kind
    make_hf(kind).save_pretrained(path, safe_serialization=True)
    model, _ = load_model(path, dtype=dtype, quantization=quantization)
    return model


def _forward(model: Transformer, cache: KVCache, items: list[tuple[list[int], list[int], int]],
             slots: list[int] | None = None, out_rows: list[int] | None = None) -> torch.Tensor:
    """items: (block table, all ids so far, computed); logits of every fed token (of `out_rows`, when
    given). `slots`: LoRA slot per item."""
    meta, positions = build_attention_metadata([(t, c, len(ids) - c) for t, ids, c in items], BLOCK, "cpu")
    flat = [tok for _, ids, c in items for tok in ids[c:]]
    lora = None
    if slots is not None:
        lora = build_lora_step(slots, [len(ids) - c for _, ids, c in items], meta.num_decode_tokens,
                               torch.device("cpu"))
    with torch.inference_mode():
        return model(torch.tensor(flat), torch.tensor(positions), meta, cache, lora, out_rows=out_rows, logits=True)


def _decode_run(model: Transformer, use_stack: bool, monkeypatch,
                slots: list[int] | None = None) -> tuple[list[torch.Tensor], KVCache]:
    """Prefill three prompts of different lengths, then six decode steps of all three together."""
    monkeypatch.setattr(transformer_module, "use_decode_stack", use_stack)
    cache = KVCache(model.config, 16, BLOCK, model.dtype, "cpu")
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    for i, (table, ids) in enumerate(zip(TABLES, seqs, strict=True)):
        _forward(model, cache, [(table, ids, 0)], None if slots is None else [slots[i]])
    out = []
    for step in range(6):
        nxt = [(ids + [(step * 7 + i) % 96], len(ids)) for i, ids in enumerate(seqs)]
        out.append(_forward(model, cache, [(t, ids, c) for t, (ids, c) in zip(TABLES, nxt, strict=True)], slots))
        seqs = [ids for ids, _ in nxt]
    return out, cache


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_through_the_stack_equal_the_layer_by_layer_path(each_isa, tmp_path, monkeypatch, kind, dtype):
    model = _packed(tmp_path, kind, dtype=dtype)
    stacked, stacked_cache = _decode_run(model, True, monkeypatch)
    assert model._decode_stack not in (None, False), "the stack should have run"
    layered, layered_cache = _decode_run(model, False, monkeypatch)
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


def test_a_wide_decode_step_through_the_stack_equals_the_layer_by_layer_path(tmp_path, monkeypatch, split_over):
    # 150 rows: more than one of the stack's silu(gate) * up tasks takes (128 rows of the tiny 128-wide MLP);
    # split over two threads, 75 rows a part: each part runs the LM head on its rows too
    model = _packed(tmp_path, "llama")
    split_over(model, 2)
    n = 150
    tables = [[1 + i] for i in range(n)]
    prompts = [[i % 96, (5 * i) % 96] for i in range(n)]
    steps = []
    for use_stack in (True, False):
        monkeypatch.setattr(transformer_module, "use_decode_stack", use_stack)
        cache = KVCache(model.config, n + 1, BLOCK, model.dtype, "cpu")
        _forward(model, cache, [(t, p, 0) for t, p in zip(tables, prompts, strict=True)])
        steps.append(_forward(model, cache, [(t, [*p, (3 * i) % 96], len(p))
                                             for i, (t, p) in enumerate(zip(tables, prompts, strict=True))]))
        if use_stack:
            assert model._decode_stack not in (None, False), "the stack should have run"
    assert torch.equal(steps[0], steps[1])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dense_bfloat16_tiles_run_in_the_stack_with_identical_bits(each_isa, tmp_path, monkeypatch, kind):
    model = _packed(tmp_path, kind, quantization="none", dtype="bfloat16")
    if not hasattr(model.model.layers[0].self_attn.q_proj, "dense_tiles"):
        pytest.skip("no AVX512-BF16 on this CPU: the dense kernel is not used")
    stacked, stacked_cache = _decode_run(model, True, monkeypatch)
    assert model._decode_stack not in (None, False)
    layered, layered_cache = _decode_run(model, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(stacked, layered, strict=True))
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


def test_q8_0_weights_run_in_the_stack_too(tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama", quantization="q8_0")
    stacked, _ = _decode_run(model, True, monkeypatch)
    layered, _ = _decode_run(model, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(stacked, layered, strict=True))


def test_fused_projections_share_the_layers_storage(tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama")
    _decode_run(model, True, monkeypatch)
    attn = model.model.layers[0].self_attn
    q, k, v = (p.packed.qs for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert k.data_ptr() == q.data_ptr() + q.nbytes and v.data_ptr() == k.data_ptr() + k.nbytes


def _separate(model: Transformer) -> Transformer:
    clear_fused(model)
    return model


@pytest.mark.parametrize("kind,quantization,dtype", [("llama", "q4_1", "bfloat16"), ("qwen2", "q4_1", "float32"),
                                                     ("qwen2", "q8_0", "bfloat16"), ("llama", "none", "bfloat16")])
def test_the_layer_paths_fused_projections_equal_the_separate_ones(each_isa, tmp_path, monkeypatch, kind, quantization,
                                                                    dtype):
    # qwen2 has q/k/v biases; "none" is the dense kernel's bfloat16 tiles
    model = _packed(tmp_path, kind, quantization=quantization, dtype=dtype)
    attn = model.model.layers[0].self_attn
    if quantization == "none" and not hasattr(attn.q_proj, "dense_tiles"):
        pytest.skip("the dense kernel does not serve bfloat16 here")
    assert attn.fused_qkv is not None and model.model.layers[0].mlp.fused_gate_up is not None
    served = []
    real = transformer_module.project_fused

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(transformer_module, "project_fused", spy)
    fused, fused_cache = _decode_run(model, False, monkeypatch)
    assert served and all(served), "every layer should have run its fused projections"
    separate, separate_cache = _decode_run(_separate(model), False, monkeypatch)
    assert attn.fused_qkv is None
    assert all(torch.equal(a, b) for a, b in zip(fused, separate, strict=True))
    assert torch.equal(fused_cache.storage, separate_cache.storage)


def test_fused_projections_add_each_projections_adapter_delta(each_isa, tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama")
    _install_adapters(model, ("q_proj", "v_proj", "up_proj"))
    slots = [1, 0, 2]
    fused, _ = _decode_run(model, False, monkeypatch, slots)
    separate, _ = _decode_run(_separate(model), False, monkeypatch, slots)
    assert all(torch.equal(a, b) for a, b in zip(fused, separate, strict=True))


def test_models_the_stack_cannot_run_keep_the_layer_path(tmp_path, monkeypatch):
    qwen3 = _packed(tmp_path, "qwen3")   # q/k norm
    _decode_run(qwen3, True, monkeypatch)
    assert qwen3._decode_stack is False
    dense32 = _packed(tmp_path, "llama", quantization="none", dtype="float32")   # no kernel weights
    _decode_run(dense32, True, monkeypatch)
    assert dense32._decode_stack is False


def _mixed_run(model: Transformer, use_stack: bool, monkeypatch, sampled_only: bool = False,
               slots: tuple[int, int, int] | None = None) -> tuple[list[torch.Tensor], KVCache]:
    """Prompts arriving while others decode: A alone; A decoding beside B's prompt; A and B beside C's
    first chunk, then beside C's second (over its cached first); then all three decode. With
    `sampled_only` each step asks for the rows that sample (a decode's, a chunk's last); `slots`: the
    LoRA slot of A, B and C."""
    monkeypatch.setattr(transformer_module, "use_decode_stack", use_stack)
    cache = KVCache(model.config, 16, BLOCK, model.dtype, "cpu")
    gen = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(0, 96, (n,), generator=gen).tolist() for n in (6, 9, 11))
    plan = [[(a, 0, 6)], [(a, 6, 1), (b, 0, 9)], [(a, 7, 1), (b, 9, 1), (c, 0, 5)],
            [(a, 8, 1), (b, 10, 1), (c, 5, 6)], [(a, 9, 1), (b, 11, 1), (c, 11, 1)], [(a, 10, 1), (b, 12, 1), (c, 12, 1)]]
    seqs = {0: a, 1: b, 2: c}
    out = []
    for step, items in enumerate(plan):
        fed, rows, flat, fed_slots = [], [], 0, []
        for seq, computed, new in items:
            i = next(k for k, v in seqs.items() if v is seq)
            while len(seq) < computed + new:
                seq.append((step * 11 + i * 3 + len(seq)) % 96)
            fed.append((TABLES[i], seq[:computed + new], computed))
            fed_slots.append(0 if slots is None else slots[i])
            flat += new
            rows.append(flat - 1)
        out.append(_forward(model, cache, fed, None if slots is None else fed_slots,
                            out_rows=rows if sampled_only else None))
    return out, cache


def _count_stacked_prompt_steps(monkeypatch) -> list[int]:
    """A counter of the steps with prompt chunks that the stack runs."""
    count = [0]
    rows = transformer_module._step_context_rows

    def counting(ctx):
        count[0] += bool(ctx.attn.prefills)
        return rows(ctx)
    monkeypatch.setattr(transformer_module, "_step_context_rows", counting)
    return count


@pytest.mark.parametrize("sampled_only", [False, True])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_steps_with_prompt_chunks_on_the_kernel_run_through_the_stack_with_identical_bits(
        each_isa, tmp_path, monkeypatch, kind, sampled_only):
    model = _packed(tmp_path, kind)
    stacked_prompts = _count_stacked_prompt_steps(monkeypatch)
    stacked, stacked_cache = _mixed_run(model, True, monkeypatch, sampled_only)
    # on the scalar path prompts attend on SDPA, so only the decode-only steps take the stack
    assert stacked_prompts == ([4] if kernels.chunk_attention_kernel_positions() > 0 else [0])
    layered, layered_cache = _mixed_run(model, False, monkeypatch, sampled_only)
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


def test_sampled_rows_through_the_stack_are_those_rows_of_the_whole_step(tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama")
    whole, whole_cache = _mixed_run(model, True, monkeypatch)
    sampled, sampled_cache = _mixed_run(model, True, monkeypatch, sampled_only=True)
    lasts = [[5], [0, 9], [0, 1, 6], [0, 1, 7], [0, 1, 2], [0, 1, 2]]
    for w, s, rows in zip(whole, sampled, lasts, strict=True):
        assert torch.equal(w[rows], s)
    assert torch.equal(whole_cache.storage, sampled_cache.storage)


def test_prompt_queries_past_the_kernels_line_keep_the_layer_path(tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama")
    monkeypatch.setattr(kernels, "chunk_attention_kernel_positions", lambda: 4)
    cache = KVCache(model.config, 16, BLOCK, model.dtype, "cpu")
    stacked_prompts = _count_stacked_prompt_steps(monkeypatch)
    _forward(model, cache, [(TABLES[0], [3, 4, 5, 6, 7], 0)])   # position 4 attends on SDPA
    assert model._decode_stack is None and stacked_prompts == [0]   # never needed, never built
    _forward(model, cache, [(TABLES[1], [3, 4, 5, 6], 0)])      # all four below the line
    assert stacked_prompts == [1]


def _install_adapters(model: Transformer, modules: tuple[str, ...], dtype: torch.dtype = torch.float32) -> None:
    """Two random rank-4 adapters in slots 1 and 2 of a serving bank, on `modules` of every layer."""
    cfg = model.config
    bank = LoraBank(cfg, 3, 4, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    for slot in (1, 2):
        factors = {}
        for layer in range(cfg.num_hidden_layers):
            for name in modules:
                i, o = module_shapes(cfg)[name]
                factors[(layer, name)] = (torch.randn(4, i, generator=gen) * 0.2, torch.randn(o, 4, generator=gen) * 0.2,
                                          2.0)
        bank.set_slot(slot, factors)
    model.lora_bank = bank


@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modules", [MODULES, ("q_proj", "v_proj", "down_proj")])
def test_adapter_decode_steps_through_the_stack_equal_the_layer_by_layer_path(each_isa, tmp_path, monkeypatch, modules,
                                                                              bank_dtype):
    model = _packed(tmp_path, "llama")
    _install_adapters(model, modules, bank_dtype)
    slots = [1, 0, 2]   # two adapters and the base in one batch
    stacked, stacked_cache = _decode_run(model, True, monkeypatch, slots)
    assert model._decode_stack not in (None, False)
    layered, layered_cache = _decode_run(model, False, monkeypatch, slots)
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stacked_cache.storage, layered_cache.storage)
    base, _ = _decode_run(model, True, monkeypatch, [0, 0, 0])
    assert not torch.equal(base[-1][0], stacked[-1][0]) and torch.equal(base[-1][1], stacked[-1][1])


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_float_weights_run_in_the_stack_with_identical_bits(each_isa, tmp_path, monkeypatch, quant, dtype):
    from gguf import GGMLQuantizationType
    from transformers import LlamaConfig, LlamaForCausalLM

    from .conftest import COMMON
    from .test_gguf import write_llama_gguf

    torch.manual_seed(0)
    # intermediate 128: every projection's K is whole groups of 32, so all of them are packed
    hf = LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 128})).eval()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf, GGMLQuantizationType[quant])
    model, _ = load_model(path, dtype=dtype, quantization="gguf-float")
    stacked, stacked_cache = _decode_run(model, True, monkeypatch)
    assert model._decode_stack not in (None, False), "the stack should have run"
    layered, layered_cache = _decode_run(model, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(stacked, layered, strict=True))
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


def test_iq4_nl_weights_run_in_the_stack_with_identical_bits(each_isa, tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType
    from transformers import LlamaConfig, LlamaForCausalLM

    from .conftest import COMMON
    from .test_gguf import write_llama_gguf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 128})).eval()
    path = tmp_path / "tiny-iq4_nl.gguf"
    write_llama_gguf(path, hf, GGMLQuantizationType.IQ4_NL)
    model, _ = load_model(path, dtype="bfloat16", quantization="gguf")
    assert model.model.layers[0].mlp.down_proj.packed.kind == "iq4_nl"
    stacked, stacked_cache = _decode_run(model, True, monkeypatch)
    assert model._decode_stack not in (None, False), "the stack should have run"
    layered, layered_cache = _decode_run(model, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(stacked, layered, strict=True))
    assert torch.equal(stacked_cache.storage, layered_cache.storage)


@pytest.fixture
def split_over():
    """split_over(model, threads): the model's stack splits every step of two rows or more over
    `threads` threads (one row a part and up), as it splits wide steps when serving."""
    before = torch.get_num_threads()

    def split(model: Transformer, threads: int) -> None:
        torch.set_num_threads(threads)
        model._decode_stack = build_decode_stack(model, kernels.load())
        model._decode_stack.min_split_rows = 1
    yield split
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("sampled_only", [False, True])
def test_a_step_split_over_threads_equals_the_whole_step_bit_for_bit(each_isa, tmp_path, monkeypatch, split_over,
                                                                     threads, sampled_only):
    # prompt chunks cut between parts (a part waits on the one before it for the chunk's K/V), parts
    # with no sampled row (they only fill the cache), decodes on their own
    model = _packed(tmp_path, "llama")
    layered, layered_cache = _mixed_run(model, False, monkeypatch, sampled_only)
    split_over(model, threads)
    stacked_prompts = _count_stacked_prompt_steps(monkeypatch)
    split, split_cache = _mixed_run(model, True, monkeypatch, sampled_only)
    assert stacked_prompts[0] == (4 if kernels.chunk_attention_kernel_positions() > 0 else 0)
    for a, b in zip(split, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(split_cache.storage, layered_cache.storage)


@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled_only", [False, True])
def test_adapter_steps_with_prompt_chunks_run_through_the_stack_with_identical_bits(
        each_isa, tmp_path, monkeypatch, sampled_only, bank_dtype):
    # A decodes under adapter 1 beside B's prompt (the base), then beside C's chunks (adapter 2)
    model = _packed(tmp_path, "llama")
    _install_adapters(model, MODULES, bank_dtype)
    stacked_prompts = _count_stacked_prompt_steps(monkeypatch)
    stacked, stacked_cache = _mixed_run(model, True, monkeypatch, sampled_only, slots=(1, 0, 2))
    assert stacked_prompts == ([4] if kernels.chunk_attention_kernel_positions() > 0 else [0])
    layered, layered_cache = _mixed_run(model, False, monkeypatch, sampled_only, slots=(1, 0, 2))
    for a, b in zip(stacked, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(stacked_cache.storage, layered_cache.storage)
    base, _ = _mixed_run(model, True, monkeypatch, sampled_only)
    assert not torch.equal(base[-1], stacked[-1])   # the adapters did change A's and C's rows


@pytest.mark.parametrize("threads", [2, 3])
def test_adapter_prompt_chunks_split_over_threads_equal_the_layer_path(each_isa, tmp_path, monkeypatch, split_over,
                                                                       threads):
    model = _packed(tmp_path, "llama")
    _install_adapters(model, MODULES)
    layered, layered_cache = _mixed_run(model, False, monkeypatch, True, slots=(1, 0, 2))
    split_over(model, threads)
    split, split_cache = _mixed_run(model, True, monkeypatch, True, slots=(1, 0, 2))
    for a, b in zip(split, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(split_cache.storage, layered_cache.storage)


def test_adapter_decode_steps_split_over_threads_equal_the_layer_path(each_isa, tmp_path, monkeypatch, split_over):
    model = _packed(tmp_path, "llama")
    _install_adapters(model, MODULES)
    slots = [1, 0, 2]
    layered, layered_cache = _decode_run(model, False, monkeypatch, slots)
    split_over(model, 3)
    split, split_cache = _decode_run(model, True, monkeypatch, slots)
    assert all(torch.equal(a, b) for a, b in zip(split, layered, strict=True))
    assert torch.equal(split_cache.storage, layered_cache.storage)


def test_the_stacks_split_threshold_is_at_least_one_row(tmp_path):
    model = _packed(tmp_path, "llama")
    stack = build_decode_stack(model, kernels.load())
    assert stack.min_split_rows == 4
    with pytest.raises(ValueError, match="at least 1"):
        stack.min_split_rows = 0


def test_a_stack_whose_layers_outgrow_the_split_bound_never_splits(tmp_path, monkeypatch):
    # each part of a split step reads every weight: past SPLIT_MAX_LAYER_BYTES a layer, steps stay whole
    import kiln.model.decode_stack as decode_stack

    model = _packed(tmp_path, "llama")
    layer = decode_stack._layer_bytes(model.model.layers[0], "packed")
    packed = [m.packed for m in (model.model.layers[0].self_attn.o_proj, model.model.layers[0].mlp.down_proj)]
    assert layer > sum(p.qs.nbytes + p.scales.nbytes for p in packed)   # every projection counts
    monkeypatch.setattr(decode_stack, "SPLIT_MAX_LAYER_BYTES", layer)
    assert build_decode_stack(model, kernels.load()).min_split_rows == 4
    monkeypatch.setattr(decode_stack, "SPLIT_MAX_LAYER_BYTES", layer - 1)
    assert build_decode_stack(model, kernels.load()).min_split_rows == decode_stack.NO_SPLIT


def test_the_stacks_row_cost_scales_with_the_layers_shapes(tmp_path):
    # a row's matrices against a position of its attention: 700 positions at SmolLM2-135M's ratio
    model = _packed(tmp_path, "llama")
    cfg = model.config
    stack = build_decode_stack(model, kernels.load())
    hidden, heads, kv_heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    macs = hidden * (heads + 2 * kv_heads) * hd + heads * hd * hidden + 3 * hidden * cfg.intermediate_size
    assert stack.row_positions == pytest.approx(700 * macs / (2 * heads * hd) / 3072)
    stack.row_positions = 5.0
    assert stack.row_positions == 5.0
    with pytest.raises(ValueError, match="negative"):
        stack.row_positions = -1.0


@pytest.mark.parametrize("row_positions", [0.5, 1e6])
def test_where_a_step_is_cut_changes_no_bits(tmp_path, monkeypatch, split_over, row_positions):
    # the cut moves with the row cost (prompt chunks cut early or late): each row's values stay
    model = _packed(tmp_path, "llama")
    layered, layered_cache = _mixed_run(model, False, monkeypatch, False)
    split_over(model, 2)
    model._decode_stack.row_positions = row_positions
    split, split_cache = _mixed_run(model, True, monkeypatch, False)
    for a, b in zip(split, layered, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(split_cache.storage, layered_cache.storage)


@pytest.mark.parametrize("quantization", ["q4_1", "none"])
def test_the_stacks_logits_are_compute_logits_of_its_hidden_states(each_isa, tmp_path, monkeypatch, split_over,
                                                                   quantization):
    # the final norm and the LM head in the stack (on each part's rows) or after it, in Python
    model = _packed(tmp_path, "llama", quantization=quantization)
    if quantization == "none" and not hasattr(model.lm_head, "dense_tiles"):
        pytest.skip("no dense kernel tiles on this CPU")
    split_over(model, 2)
    assert model._decode_stack.has_head
    monkeypatch.setattr(transformer_module, "use_decode_stack", True)
    cache = KVCache(model.config, 16, BLOCK, model.dtype, "cpu")
    items = [(TABLES[0], [5, 6, 7, 8, 9, 10], 0), (TABLES[1], [11, 12, 13, 14], 0)]
    meta, positions = build_attention_metadata([(t, c, len(ids) - c) for t, ids, c in items], BLOCK, "cpu")
    args = (torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), torch.tensor(positions), meta, cache)
    with torch.inference_mode():
        logits = model(*args, out_rows=[5, 9], logits=True)
        hidden = model(*args, out_rows=[5, 9])
        assert torch.equal(logits, model.compute_logits(hidden, packed_ok=True))
        assert logits.dtype == torch.float32 and logits.shape == (2, model.config.vocab_size)


def test_the_stack_refuses_sampled_rows_out_of_order(tmp_path, monkeypatch):
    model = _packed(tmp_path, "llama")
    monkeypatch.setattr(transformer_module, "use_decode_stack", True)
    cache = KVCache(model.config, 16, BLOCK, model.dtype, "cpu")
    for table, ids in zip(TABLES, ([1, 2], [3, 4], [5, 6]), strict=True):
        _forward(model, cache, [(table, ids, 0)])
    meta, positions = build_attention_metadata([(t, 2, 1) for t in TABLES], BLOCK, "cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match="ascending"):
        model(torch.tensor([7, 8, 9]), torch.tensor(positions), meta, cache, out_rows=[2, 0])
