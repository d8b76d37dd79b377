"""`--quantization auto`'s choice of weights, decided from facts alone (kiln/model/auto_weights.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kiln.model.auto_weights import DENSE_MAX_BYTES, AutoFacts, choose

MB = 1 << 20
# SmolLM2-135M Q4_1 on AMD's AVX512-BF16: 270 MB in bfloat16, every projection in Q4_1 blocks
SMOLLM2_ZEN4 = AutoFacts(on_cpu=True, is_gguf=True, kernels=True, bf16_wins=True, isa="avx512",
                         projection_elements=100, kquant_elements=0, packable_elements=100, dense_bytes=270 * MB)
# a 1B Q8_0 / Q4_0 file: 2.5 GB in bfloat16
ONE_B_ZEN4 = dataclasses.replace(SMOLLM2_ZEN4, dense_bytes=2470 * MB)


def test_a_small_q4_or_q8_file_serves_dense_bfloat16_where_vdpbf16ps_is_fast():
    choice = choose(SMOLLM2_ZEN4)
    assert choice.quantization == "none"
    assert "270 MB" in choice.reason and "sits in the caches" in choice.reason


def test_a_real_size_q4_or_q8_file_serves_its_blocks_and_keeps_no_dense_copy():
    choice = choose(ONE_B_ZEN4)
    assert choice.quantization == "gguf"
    assert "keeps no dense copy" in choice.reason and "2470 MB" in choice.reason


def test_the_dense_copy_limit_is_inclusive():
    assert choose(dataclasses.replace(SMOLLM2_ZEN4, dense_bytes=DENSE_MAX_BYTES)).quantization == "none"
    assert choose(dataclasses.replace(SMOLLM2_ZEN4, dense_bytes=DENSE_MAX_BYTES + 1)).quantization == "gguf"


@pytest.mark.parametrize("facts", [SMOLLM2_ZEN4, ONE_B_ZEN4])
def test_k_quant_files_serve_their_blocks_with_8_bit_activations_at_any_size(facts):
    choice = choose(dataclasses.replace(facts, kquant_elements=60))
    assert choice.quantization == "gguf" and "K-quant" in choice.reason


@pytest.mark.parametrize(("isa", "why"), [("avx512", "half its float32 FMAs' rate"), ("avx2", "avx2 kernels")])
def test_without_fast_bf16_dots_a_small_q4_or_q8_file_serves_its_blocks_with_float_activations(isa, why):
    choice = choose(dataclasses.replace(SMOLLM2_ZEN4, bf16_wins=False, isa=isa))
    assert choice.quantization == "gguf-float" and why in choice.reason and "answers" in choice.reason


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_without_fast_bf16_dots_a_real_size_q4_or_q8_file_serves_its_blocks_with_8_bit_activations(isa):
    choice = choose(dataclasses.replace(ONE_B_ZEN4, bf16_wins=False, isa=isa))
    assert choice.quantization == "gguf" and "compute-bound" in choice.reason


@pytest.mark.parametrize("change", [{"on_cpu": False}, {"is_gguf": False}, {"kernels": False},
                                    {"packable_elements": 40}, {"projection_elements": 0}])
def test_dense_weights_without_blocks_kernels_or_a_cpu_and_nothing_to_explain(change):
    choice = choose(dataclasses.replace(ONE_B_ZEN4, **change))
    assert choice == choice.__class__("none", None)


def test_every_explained_choice_names_the_alternatives():
    for facts in (SMOLLM2_ZEN4, ONE_B_ZEN4, dataclasses.replace(ONE_B_ZEN4, bf16_wins=False, isa="avx2")):
        assert "--quantization" in choose(facts).reason


def test_an_iq4_file_serves_its_blocks_with_8_bit_activations_on_every_cpu():
    for facts in (SMOLLM2_ZEN4, ONE_B_ZEN4, dataclasses.replace(ONE_B_ZEN4, bf16_wins=False, isa="avx2")):
        choice = choose(dataclasses.replace(facts, iq4_elements=100))
        assert choice.quantization == "gguf" and "IQ4_NL/IQ4_XS blocks" in choice.reason
