"""The host pool (tiermem/store/pool.py): hard capacity, aligned disjoint blocks, and slabs cut
to whole blocks of the size that opens them (Note [slab tail])."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.store.pool import ALIGN_BYTES, HostPool

KiB = 1024


def _fill(pool: HostPool, nbytes: int) -> list:
    blocks = []
    while (block := pool.alloc(nbytes)) is not None:
        blocks.append(block)
    return blocks


def test_blocks_of_one_size_fill_the_whole_capacity():
    """10 slabs' worth of 64 KiB and blocks of 12 KiB: a 64 KiB slab would keep a 4 KiB tail
    each (50 blocks in all); slabs of 60 KiB leave no tail, so floor(640 / 12) = 53 fit."""
    pool = HostPool(capacity_bytes=640 * KiB, slab_bytes=64 * KiB, pin=False)
    blocks = _fill(pool, 12 * KiB)
    assert len(blocks) == 640 // 12
    assert pool.reserved_bytes <= 640 * KiB
    assert all(s.nbytes % (12 * KiB) == 0 for s in pool._slabs[:-1])  # the last: what was left
    assert pool.used_bytes == 53 * 12 * KiB


def test_a_request_larger_than_a_slab_gets_its_own_and_smaller_ones_fill_around_it():
    pool = HostPool(capacity_bytes=256 * KiB, slab_bytes=32 * KiB, pin=False)
    big = pool.alloc(100 * KiB)
    assert big is not None and big.slab.nbytes == 100 * KiB  # page-rounded, a slab of its own
    small = _fill(pool, 16 * KiB)
    assert len(small) == (256 - 100) // 16
    assert pool.reserved_bytes <= 256 * KiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * KiB)), min_size=1, max_size=60))
def test_any_sequence_stays_within_capacity_with_aligned_disjoint_blocks(ops):
    """Allocations of mixed sizes and frees in any order: the slabs never exceed the capacity,
    every block is page aligned, as large as asked, and no two live blocks overlap."""
    pool = HostPool(capacity_bytes=192 * KiB, slab_bytes=64 * KiB, pin=False)
    live = []
    for free_one, nbytes in ops:
        if free_one and live:
            pool.free(live.pop(nbytes % len(live)))
            continue
        block = pool.alloc(nbytes)
        if block is not None:
            assert block.tensor.numel() == block.alloc_bytes >= nbytes
            assert block.tensor.data_ptr() % ALIGN_BYTES == 0
            live.append(block)
        assert pool.reserved_bytes <= pool.capacity_bytes
        assert pool.used_bytes == sum(b.alloc_bytes for b in live)
    spans = sorted((b.tensor.data_ptr(), b.tensor.data_ptr() + b.alloc_bytes) for b in live)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
