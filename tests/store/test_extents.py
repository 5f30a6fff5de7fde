"""ExtentAllocator: first/best fit, coalescing, errors, and a hypothesis state-machine test."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.store.extents import ExtentAllocator, round_up
from tiermem.store.pool import block_bytes

A = 4096


def test_round_up():
    assert [round_up(n, A) for n in (0, 1, 4095, 4096, 4097)] == [0, A, A, A, 2 * A]
    # a pool block is never empty: one page at 0 bytes
    assert [block_bytes(n) for n in (0, 1, 4095, 4096, 4097)] == [A, A, A, A, 2 * A]


def test_first_fit_and_coalescing():
    ea = ExtentAllocator(10 * A + 123)  # rounded down to 10 pages
    assert ea.capacity_bytes == 10 * A and ea.largest_free_bytes == 10 * A
    offs = [ea.alloc(A) for _ in range(4)]
    assert offs == [0, A, 2 * A, 3 * A] and ea.used_bytes == 4 * A
    ea.free(A, A)
    ea.free(2 * A, A)                      # merges with the previous hole
    assert ea.free_runs() == [(A, 2 * A), (4 * A, 6 * A)]
    assert ea.alloc(1) == A                # first fit: lowest address
    assert ea.alloc(3 * A) == 4 * A        # the 1-page hole at 2A is too small
    ea.free(0, A)
    ea.free(A, 1)
    ea.free(3 * A, A)
    ea.free(4 * A, 3 * A)
    assert ea.free_runs() == [(0, 10 * A)] and ea.used_bytes == 0 and ea.num_allocated == 0


def test_best_fit_takes_smallest_run():
    ea = ExtentAllocator(10 * A, fit="best")
    a, b, c = ea.alloc(2 * A), ea.alloc(A), ea.alloc(A)
    ea.free(a, 2 * A)                      # holes: [0, 2A) and [4A, 10A)
    ea.free(c, A)                          # [3A, 10A) after merging
    assert ea.alloc(A) == 0                # smallest fitting run is the 2-page one
    assert ea.free_runs() == [(A, A), (3 * A, 7 * A)]
    del b


def test_full_and_errors():
    ea = ExtentAllocator(2 * A)
    assert ea.alloc(3 * A) is None and ea.used_bytes == 0
    assert ea.alloc(2 * A) == 0 and ea.alloc(1) is None and not ea.fits(1)
    with pytest.raises(ValueError, match="double free or wrong size"):
        ea.free(0, A)                      # wrong size: the extent is 2 pages
    ea.free(0, 2 * A)
    with pytest.raises(ValueError, match="not an allocated extent"):
        ea.free(0, 2 * A)                  # double free
    with pytest.raises(ValueError, match="nbytes=-1"):
        ea.alloc(-1)
    with pytest.raises(ValueError, match="capacity_bytes=-5"):
        ExtentAllocator(-5)
    with pytest.raises(ValueError, match="fit='worst'"):
        ExtentAllocator(A, fit="worst")
    assert ExtentAllocator(0).alloc(1) is None


@settings(max_examples=60, deadline=None)
@given(fit=st.sampled_from(["first", "best"]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5 * A), st.integers(0, 10**6)),
                    max_size=120))
def test_random_alloc_free_never_overlaps(fit, ops):
    cap = 64 * A
    ea = ExtentAllocator(cap, fit=fit)
    live: dict[int, int] = {}               # offset -> rounded size
    for is_alloc, nbytes, pick in ops:
        if is_alloc or not live:
            size = round_up(max(nbytes, 1), A)
            could_fit = ea.largest_free_bytes >= size
            off = ea.alloc(nbytes)
            assert (off is not None) == could_fit
            if off is not None:
                assert off % A == 0 and 0 <= off and off + size <= cap
                for o, s in live.items():
                    assert off + size <= o or o + s <= off, "overlap"
                live[off] = size
        else:
            off = sorted(live)[pick % len(live)]
            ea.free(off, live.pop(off))
        assert ea.used_bytes == sum(live.values())
        runs = ea.free_runs()
        assert sum(n for _, n in runs) == cap - ea.used_bytes
        for (s1, n1), (s2, _) in zip(runs, runs[1:]):
            assert s1 + n1 < s2, "adjacent free runs must have been coalesced"
        assert ea.largest_free_bytes == max((n for _, n in runs), default=0)
    for off, size in list(live.items()):
        ea.free(off, size)
    assert ea.free_runs() == [(0, cap)] and ea.used_bytes == 0
