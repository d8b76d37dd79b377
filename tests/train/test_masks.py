"""Loss masks: exactly the assistant turns (content + end-of-turn token) are trained."""

from __future__ import annotations

import pytest

from kiln.train.masks import MaskError, mask_conversation

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Sky colour?"},
    {"role": "assistant", "content": "Blue."},
]


def trained_runs(tokenizer, seq) -> list[str]:
    """The decoded text of each contiguous run of trained tokens."""
    runs, current = [], []
    for tid, on in zip(seq.input_ids, seq.trained, strict=True):
        if on:
            current.append(tid)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_exactly_each_assistant_content_and_its_end_of_turn_token(tokenizer, chatml):
    seq = mask_conversation(chatml, tokenizer, CONVERSATION)
    assert trained_runs(tokenizer, seq) == ["Paris.<|im_end|>", "Blue.<|im_end|>"]


def test_masked_tokens_are_the_rest_of_the_rendered_conversation(tokenizer, chatml):
    seq = mask_conversation(chatml, tokenizer, CONVERSATION)
    masked = tokenizer.decode([t for t, on in zip(seq.input_ids, seq.trained, strict=True) if not on])
    assert masked == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n\n<|im_start|>user\nSky colour?<|im_end|>\n<|im_start|>assistant\n\n")
    assert tokenizer.decode(seq.input_ids) == chatml.render(CONVERSATION, add_generation_prompt=False)


def test_qwen3_template_trains_what_the_model_generates_after_the_generation_prompt(tokenizer, qwen_template):
    # Qwen3's template gives the final assistant turn an empty think block; earlier turns have none.
    seq = mask_conversation(qwen_template, tokenizer, CONVERSATION)
    assert trained_runs(tokenizer, seq) == ["Paris.<|im_end|>", "<think>\n\n</think>\n\nBlue.<|im_end|>"]


def test_only_last_trains_the_final_assistant_turn_alone(tokenizer, chatml):
    seq = mask_conversation(chatml, tokenizer, CONVERSATION, only_last=True)
    assert trained_runs(tokenizer, seq) == ["Blue.<|im_end|>"]


def test_truncation_keeps_the_first_max_len_tokens(tokenizer, chatml):
    full = mask_conversation(chatml, tokenizer, CONVERSATION)
    cut = mask_conversation(chatml, tokenizer, CONVERSATION, max_len=10)
    assert cut.truncated and not full.truncated
    assert cut.input_ids == full.input_ids[:10] and cut.trained == full.trained[:10]


def test_a_conversation_without_an_assistant_turn_cannot_be_masked(tokenizer, chatml):
    with pytest.raises(MaskError, match="no assistant message"):
        mask_conversation(chatml, tokenizer, CONVERSATION[:2])
