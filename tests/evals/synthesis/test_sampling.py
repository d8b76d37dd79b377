"""Seed, generator and reservoir (semantics.md §10.2): portable and reproducible."""

from kiln.evals.synthesis.sampling import Reservoir, SplitMix64, effective_seed, fnv1a64


def test_splitmix64_matches_the_reference_sequence():
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_fnv1a64_matches_the_reference_values():
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a64("foobar") == 0x85944171F73967E8


def test_an_explicit_seed_is_the_effective_seed():
    assert effective_seed(42, "suite", clock_ns=lambda: 999) == 42


def test_without_a_seed_the_clock_is_mixed_with_the_suite_name():
    assert effective_seed(None, "a", clock_ns=lambda: 5) == 5 ^ 0xAF63DC4C8601EC8C


def test_a_reservoir_that_never_fills_keeps_every_item_in_order():
    res = Reservoir(10, SplitMix64(1))
    for i in range(7):
        res.offer(i)
    assert res.items == list(range(7))


def test_an_uncapped_reservoir_keeps_everything():
    res = Reservoir(None, SplitMix64(1))
    for i in range(500):
        res.offer(i)
    assert res.items == list(range(500))


def test_a_full_reservoir_holds_cap_distinct_items_chosen_by_the_seed():
    def sample(seed):
        res = Reservoir(5, SplitMix64(seed))
        for i in range(100):
            res.offer(i)
        return res.items

    assert len(sample(3)) == 5 and len(set(sample(3))) == 5
    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_reservoir_replacement_follows_algorithm_r():
    # Item n (1-based) replaces slot r = rng % n when r < cap.
    rng = SplitMix64(9)
    draws = [rng.next_u64() for _ in range(3)]
    res = Reservoir(2, SplitMix64(9))
    expected = ["a", "b"]
    for n, (item, draw) in enumerate(zip(["c", "d", "e"], draws, strict=True), start=3):
        if draw % n < 2:
            expected[draw % n] = item
    for item in "abcde":
        res.offer(item)
    assert res.items == expected
