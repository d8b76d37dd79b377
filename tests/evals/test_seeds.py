import pytest

from kiln.errors import KilnError
from kiln.evals.seeds import (
    SEED_DERIVATION,
    derive_generation_seed,
    effective_job_seed,
    parse_u64,
    seed_root_for,
)


def test_derived_seed_matches_the_golden_value():
    assert derive_generation_seed(42, "example-7", 3) == 1961911680962343893


def test_derived_seed_depends_on_id_and_index():
    seeds = {derive_generation_seed(42, eid, i) for eid in ("a", "b") for i in range(3)}
    assert len(seeds) == 6


def test_seed_derivation_name_is_versioned():
    assert SEED_DERIVATION == "kiln.eval-seed.v1"


def test_job_seed_takes_the_first_set_candidate():
    assert effective_job_seed(None, 7, 9) == 7


def test_job_seed_is_random_u64_when_nothing_is_set():
    assert 0 <= effective_job_seed(None, None) < 2**64


def test_generation_object_seed_beats_job_seed():
    assert seed_root_for(5, 42) == 5
    assert seed_root_for(None, 42) == 42


@pytest.mark.parametrize(("value", "expected"), [(42, 42), ("42", 42), ("18446744073709551615", 2**64 - 1)])
def test_u64_accepts_numbers_and_decimal_strings(value, expected):
    assert parse_u64(value) == expected


@pytest.mark.parametrize("value", [-1, 2**64, "4x", "", True, 1.5, None])
def test_u64_rejects_everything_else(value):
    with pytest.raises(KilnError) as e:
        parse_u64(value, param="seed")
    assert (e.value.status, e.value.code, e.value.param) == (400, "eval_invalid_request", "seed")
