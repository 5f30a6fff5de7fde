"""Note [slab tail] against torch's real pinned allocator: what it pins for the pool's slabs
(``torch.cuda.host_memory_stats``: bytes of pinned blocks, active + cached, rounded as pinned)
is what the pool counts, within ``capacity_bytes``, and back to nothing after ``trim``."""

from __future__ import annotations

import pytest
import torch

from tiermem.store.pool import HostPool

pytestmark = pytest.mark.cuda

MiB = 1 << 20


def _pinned_now() -> int:
    return torch.cuda.host_memory_stats()["allocated_bytes.current"]


def test_torch_pins_exactly_the_slabs_the_pool_counts():
    """5 slabs of 64 MiB and a remainder of 40 MiB + 3 pages, filled with 12 MiB blocks: torch
    pins what the pool counts (64 MiB x 5, then 32 MiB: the 8 MiB left holds no 12 MiB block),
    never more than the capacity; freed and trimmed, the pinned bytes return to where they were.
    The twin: a 60 MiB tensor, a size the old pool cut, pins 64 MiB (torch's rounding, Note
    [pinned rounding]), so counting requested bytes would have been short."""
    torch.accelerator.empty_host_cache()
    before = _pinned_now()
    capacity = 5 * 64 * MiB + 40 * MiB + 3 * 4096
    pool = HostPool(capacity, 64 * MiB, pin=True)
    blocks = []
    while (block := pool.alloc(12 * MiB)) is not None:
        assert block.tensor.is_pinned()
        blocks.append(block)
    pinned = _pinned_now() - before
    assert pinned == pool.reserved_bytes <= capacity
    assert len(blocks) == 5 * 5 + 2  # 5 per 64 MiB slab, 2 in the 32 MiB one
    for block in blocks:
        pool.free(block)
    blocks.clear()
    assert pool.trim() == pinned
    assert _pinned_now() == before  # the dropped slabs are unpinned, not kept in torch's cache
    twin = torch.empty(60 * MiB, dtype=torch.uint8, pin_memory=True)
    assert _pinned_now() - before == 64 * MiB
    del twin
    torch.accelerator.empty_host_cache()
