"""Prompt-logprob scoring (kiln.engine.scoring, semantics.md §5.2) on fixed logits and a tiny model."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.scoring import compute_prompt_scores, prompt_logprob_entries
from kiln.errors import KilnError


class FixedLogits:
    """A stand-in model whose logits row i is `rows[i]` whatever the input."""

    device = torch.device("cpu")

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = torch.tensor(rows, dtype=torch.float32)

    def forward_dense(self, ids: torch.Tensor, lora=None) -> torch.Tensor:
        return self.rows[: ids.shape[1]].unsqueeze(0)


class ByteTokenizer:
    """ids are UTF-8 bytes; decoding replaces an incomplete character with U+FFFD."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_logprobs_are_the_log_softmax_of_the_previous_row():
    rows = [[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [0.0] * 4]
    scores = compute_prompt_scores(FixedLogits(rows), [0, 2, 1], 2)
    ref = torch.log_softmax(torch.tensor(rows[:2]), dim=-1)
    assert scores.observed_logprobs == pytest.approx([ref[0, 2].item(), ref[1, 1].item()], abs=1e-6)
    assert scores.top_ids == [[3, 2], [0, 1]]


def test_observed_rank_counts_logits_at_or_above_it():
    scores = compute_prompt_scores(FixedLogits([[5.0, 1.0, 3.0, 3.0], [0.0] * 4]), [9, 3], 1)
    assert scores.observed_ranks == [3]  # 5, 3 and 3 are >= 3


def test_ties_at_the_top_k_boundary_go_to_the_lower_id():
    scores = compute_prompt_scores(FixedLogits([[1.0, 2.0, 2.0, 2.0, 0.0], [0.0] * 5]), [0, 4], 2)
    assert scores.top_ids == [[1, 2]]


def test_non_finite_logits_are_a_generation_error():
    with pytest.raises(KilnError) as e:
        compute_prompt_scores(FixedLogits([[float("nan"), 0.0], [0.0, 0.0]]), [0, 1], 1)
    assert e.value.status == 500 and e.value.code == "generation_error"


def test_entries_put_the_observed_token_with_its_full_rank_beside_the_top_k():
    rows = [[0.0, 1.0, 2.0, 3.0], [0.0] * 4]
    ids = [65, 0]
    scores = compute_prompt_scores(FixedLogits(rows), ids, 2)
    entries = prompt_logprob_entries(ids, scores, ByteTokenizer())
    assert entries[0] is None
    assert list(entries[1]) == ["0", "2", "3"]  # decimal ids sorted as strings
    assert entries[1]["3"]["rank"] == 1 and entries[1]["2"]["rank"] == 2
    assert entries[1]["0"]["rank"] == 4


def test_observed_token_inside_the_top_k_keeps_its_top_k_rank():
    rows = [[0.0, 1.0, 2.0, 3.0], [0.0] * 4]
    entries = prompt_logprob_entries([65, 2], compute_prompt_scores(FixedLogits(rows), [65, 2], 2), ByteTokenizer())
    assert len(entries[1]) == 2 and entries[1]["2"]["rank"] == 2


def test_decoded_token_completes_a_character_split_across_tokens():
    e_acute = list("é".encode())  # two bytes
    ids = [ord("x"), *e_acute]
    rows = [[0.0] * 256 for _ in ids]
    entries = prompt_logprob_entries(ids, compute_prompt_scores(FixedLogits(rows), ids, 0), ByteTokenizer())
    assert entries[2][str(e_acute[1])]["decoded_token"] == "é"


def test_tiny_model_scores_match_a_dense_reference(tmp_path):
    from kiln.model.loader import load_model
    from kiln.testing.tiny import make_tiny_model

    model, _ = load_model(make_tiny_model(tmp_path / "m", arch="qwen2", init_std=0.3), dtype="float32")
    ids = [5, 77, 300, 12, 9, 600]
    scores = compute_prompt_scores(model, ids, 5)
    with torch.no_grad():
        ref = torch.log_softmax(model.forward_dense(torch.tensor([ids]))[0].double(), dim=-1)
    for p in range(1, len(ids)):
        assert scores.observed_logprobs[p - 1] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert scores.top_ids[p - 1] == ref[p - 1].topk(5).indices.tolist()
