"""The training forward is `forward_dense`: same hidden states and log-probs, less memory."""

from __future__ import annotations

import torch

from kiln.model.config import ModelConfig
from kiln.train import forward
from kiln.train.batch import collate, per_target, target_logprobs
from kiln.train.forward import checkpointed_layers, final_hidden, saved_bytes_per_token
from kiln.train.masks import MaskedSequence
from kiln.train.trainable_lora import TrainableLora


def lora_with_weights(model) -> TrainableLora:
    lora = TrainableLora(model.config, 4, 8, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in lora.b.values():
            b.normal_(0, 0.3, generator=gen)
    return lora


def test_final_hidden_gives_forward_dense_logits_with_and_without_padding(tiny_model):
    lora = lora_with_weights(tiny_model)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for attention in (None, mask):
        want = tiny_model.forward_dense(ids, attention, lora=lora)
        got = tiny_model.compute_logits(final_hidden(tiny_model, ids, attention, lora))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def lora_grads(model, ids, checkpoint_layers):
    lora = lora_with_weights(model)
    final_hidden(model, ids, None, lora, checkpoint_layers=checkpoint_layers).square().sum().backward()
    return [p.grad.clone() for p in lora.parameters()]


def assert_same_grads(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_checkpointed_layers_give_the_same_gradients(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert_same_grads(lora_grads(tiny_model, ids, True), lora_grads(tiny_model, ids, False))


def test_small_batches_keep_every_layer_and_big_ones_recompute_only_what_the_budget_requires(tiny_model):
    cfg = tiny_model.config
    per_token = saved_bytes_per_token(cfg)
    layers = cfg.num_hidden_layers
    assert checkpointed_layers(cfg, 100, budget=100 * per_token * layers) == 0
    assert checkpointed_layers(cfg, 100, budget=100 * per_token * (layers - 1)) == 1
    assert checkpointed_layers(cfg, 100, budget=100 * per_token - 1) == layers
    assert checkpointed_layers(cfg, 10**9) == layers


def test_the_learning_loops_batch_of_smollm2_fits_the_default_budget():
    smollm2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)
    assert checkpointed_layers(smollm2, 4 * 56) == 0        # 4 rows of ~55 tokens: no recompute
    assert 0 < checkpointed_layers(smollm2, 4 * 512) < 30   # 4 rows of 512: some layers recompute


def test_a_partly_checkpointed_forward_gives_the_same_gradients(tiny_model, monkeypatch):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    # room for one layer's activations: the first layer is recomputed, the second kept
    monkeypatch.setattr(forward, "ACTIVATION_BUDGET_BYTES", ids.numel() * saved_bytes_per_token(tiny_model.config))
    assert checkpointed_layers(tiny_model.config, ids.numel()) == tiny_model.config.num_hidden_layers - 1
    assert_same_grads(lora_grads(tiny_model, ids, None), lora_grads(tiny_model, ids, False))


def test_target_logprobs_are_the_trained_positions_of_the_full_log_softmax(tiny_model):
    seqs = [MaskedSequence([5, 6, 7, 8], [False, False, True, True]), MaskedSequence([9, 10, 11], [False, True, False])]
    batch = collate(seqs)
    got = target_logprobs(tiny_model, batch, None)
    full = torch.log_softmax(tiny_model.forward_dense(batch.input_ids, batch.attention), -1)
    want = torch.stack([full[0, 1, 7], full[0, 2, 8], full[1, 0, 10]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert per_target(batch, torch.tensor([1.0, 2.0])).tolist() == [1.0, 1.0, 2.0]


def test_the_last_layer_at_the_trained_positions_gives_the_full_layers_values_and_gradients(tiny_model):
    """Only the trained positions' last-layer outputs are computed (their queries against every key of
    their own sequence): the same log-probabilities and LoRA gradients as the whole layer's, with and
    without padding, one sequence or several."""
    seqs = [MaskedSequence([5, 6, 7, 8, 9, 4], [False, False, True, True, False, True]),
            MaskedSequence([9, 10, 11], [False, True, True]),
            MaskedSequence([3, 12, 13, 14, 15, 16], [False, False, False, False, True, True])]
    for batch in (collate(seqs), collate(seqs[:1]), collate([seqs[0], seqs[2]])):
        attention = None if bool(batch.attention.all()) else batch.attention
        chosen = batch.target_mask.bool()
        results = []
        for rows in (True, False):
            lora = lora_with_weights(tiny_model)
            if rows:
                hidden = final_hidden(tiny_model, batch.input_ids, attention, lora,
                                      rows=torch.nn.functional.pad(chosen, (0, 1)))
            else:
                hidden = final_hidden(tiny_model, batch.input_ids, attention, lora)[:, :-1][chosen]
            logits = tiny_model.compute_logits(hidden)
            logits.square().sum().backward()
            results.append((logits.detach(), [p.grad.clone() for p in lora.parameters()]))
        (got, got_grads), (want, want_grads) = results
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for x, y in zip(got_grads, want_grads, strict=True):   # float32 rounding of sums in the thousands
            torch.testing.assert_close(x, y, rtol=0, atol=float(y.abs().max()) * 1e-5)


def test_no_trained_position_gives_an_empty_slice_that_backward_accepts(tiny_model):
    lora = lora_with_weights(tiny_model)
    ids = torch.tensor([[5, 6, 7]])
    hidden = final_hidden(tiny_model, ids, None, lora, rows=torch.zeros(1, 3, dtype=torch.bool))
    assert hidden.shape == (0, tiny_model.config.hidden_size)
    tiny_model.compute_logits(hidden).sum().backward()
