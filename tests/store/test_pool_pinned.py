"""The pinned host pool (Note [slab tail] in tiermem/store/pool.py): torch pins the next power
of two of every request (Note [pinned rounding]), so pinned slabs are cut as powers of two and
``capacity_bytes`` bounds what is pinned. Run without CUDA: the pool's ``torch`` is replaced by
one whose ``empty`` gives meta tensors (no memory), so 80 GiB pools are replayed as the H200
would cut them, and the sizing itself is a pure function (:func:`slab_cut`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiermem.store.pool as pool_mod
from tiermem.store.pool import HostPool

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CHUNK_48 = 48 * MiB  # 4M elements' state with fp32 moments (the 13B NVMe preset's chunks)


def _pinned(nbytes: int) -> int:
    """What torch's caching host allocator pins for ``nbytes`` (the next power of two),
    written out here so the tests need nothing new from the pool."""
    return 1 << (nbytes - 1).bit_length()


@pytest.fixture
def fake_pin(monkeypatch):
    """The pool's torch, pinning nothing: ``empty`` gives a meta tensor of the size asked
    (the pool's decisions are all it does); counts the host cache flushes."""
    flushes = []

    def empty(n, dtype, pin_memory=False):
        return torch.empty(n, dtype=dtype, device="meta")

    fake = SimpleNamespace(empty=empty, uint8=torch.uint8, Tensor=torch.Tensor,
                           accelerator=SimpleNamespace(empty_host_cache=lambda: flushes.append(1)))
    monkeypatch.setattr(pool_mod, "torch", fake)
    return flushes


def _fill(pool: HostPool, nbytes: int) -> list:
    blocks = []
    while (block := pool.alloc(nbytes)) is not None:
        blocks.append(block)
    return blocks


def _pinned_sum(pool: HostPool) -> int:
    return sum(_pinned(s.nbytes) for s in pool._slabs)


@pytest.mark.parametrize("capacity", [80 * GiB, 88 * GiB, int(81.5 * GiB), 7 * GiB + 100 * MiB])
def test_pinned_slabs_never_pin_beyond_capacity(fake_pin, capacity):
    """48 MiB chunks fill 1 GiB-slab pools: what torch pins for the slabs stays within the
    capacity. Red on the old pool: 1008 MiB slabs pinned 1 GiB each (88 GiB: 89.4 GiB)."""
    pool = HostPool(capacity_bytes=capacity, slab_bytes=GiB, pin=True)
    blocks = _fill(pool, CHUNK_48)
    assert _pinned_sum(pool) <= capacity
    assert pool.reserved_bytes == _pinned_sum(pool)  # the pool counts what is pinned
    assert len(blocks) >= capacity // GiB * 21  # a 1 GiB slab: 21 chunks and a 16 MiB tail


def test_slab_cut_48mib_blocks_in_1gib_slabs():
    cut = pool_mod.slab_cut
    assert cut(80 * GiB, CHUNK_48, GiB, pin=True) == GiB  # 21 chunks and a 16 MiB tail
    assert cut(80 * GiB, CHUNK_48, GiB, pin=False) == 21 * CHUNK_48  # pageable: whole chunks
    assert cut(80 * GiB, CHUNK_48, 21 * CHUNK_48, pin=True) == 512 * MiB  # rounded down
    assert pool_mod.pool_blocks(80 * GiB, CHUNK_48, GiB) == 80 * 21  # not 80 GiB / 48 MiB = 1706
    assert pool_mod.pool_blocks(80 * GiB, CHUNK_48, GiB, pin=False) == 1706


def test_slab_cut_remainders_take_the_largest_power_of_two_that_fits():
    cut = pool_mod.slab_cut
    assert cut(100 * MiB, CHUNK_48, GiB, pin=True) == 64 * MiB  # one chunk, a 16 MiB tail
    assert cut(36 * MiB, CHUNK_48, GiB, pin=True) is None  # 32 MiB cannot hold it
    assert cut(GiB + 4096, 4096, 2 * GiB, pin=True) == GiB  # then a 4096-byte slab
    assert cut(4096, 4096, GiB, pin=True) == 4096
    assert cut(4095, 4096, GiB, pin=True) is None


def test_a_request_larger_than_slab_bytes_gets_the_next_power_of_two_or_none():
    cut = pool_mod.slab_cut
    big = 1536 * MiB
    assert cut(3 * GiB, big, GiB, pin=True) == 2 * GiB  # its own slab; smaller blocks fill the rest
    assert cut(2 * GiB - 4096, big, GiB, pin=True) is None  # it would pin 2 GiB
    assert cut(3 * GiB, big, GiB, pin=False) == big  # pageable: its own size


@settings(max_examples=200, deadline=None)
@given(room_pages=st.integers(0, 1 << 20), alloc_pages=st.integers(1, 1 << 16),
       slab_pages=st.integers(1, 1 << 18))
def test_power_of_two_slabs_cut_from_a_room_pin_nothing_beyond_it(room_pages, alloc_pages,
                                                                   slab_pages):
    """Cutting slabs until none fits: each is a power of two (what torch pins for it) at
    least the block; they sum to at most the room; and a room of whole pages is used to the
    last page by 4096-byte blocks."""
    room = left = room_pages * 4096
    alloc, slab = alloc_pages * 4096, slab_pages * 4096
    while (size := pool_mod.slab_cut(left, alloc, slab, pin=True)) is not None:
        assert size == _pinned(size) and alloc <= size <= left
        assert size <= max(_pinned(slab) // (2 if _pinned(slab) != slab else 1), _pinned(alloc))
        left -= size
    largest = 1 << (room.bit_length() - 1) if room else 0  # the largest slab within the room
    assert (left < room) == (largest >= alloc) and left >= 0
    assert pool_mod.pool_blocks(room, 4096, slab) == room_pages  # nothing lost to the cuts
    need = pool_mod.pool_room(7, alloc, slab)
    assert pool_mod.pool_blocks(need, alloc, slab) >= 7


def test_the_budget_is_usable_to_the_last_page_by_blocks_that_fit(fake_pin):
    """A capacity of 1 GiB + 100 MiB + 3 pages: slabs of 1 GiB, 64, 32, 4 MiB and 8 + 4 KiB,
    filled by 4096-byte blocks, are the whole capacity and exactly what is pinned."""
    capacity = GiB + 100 * MiB + 3 * 4096
    pool = HostPool(capacity_bytes=capacity, slab_bytes=GiB, pin=True)
    blocks = _fill(pool, 4096)
    assert len(blocks) == capacity // 4096
    assert sorted(s.nbytes for s in pool._slabs) == [4096, 8192, 4 * MiB, 32 * MiB, 64 * MiB, GiB]
    assert pool.reserved_bytes == _pinned_sum(pool) == capacity


def test_a_slab_tail_serves_smaller_blocks(fake_pin):
    pool = HostPool(capacity_bytes=2 * GiB, slab_bytes=GiB, pin=True)
    chunks = [pool.alloc(CHUNK_48) for _ in range(21)]
    assert len(pool._slabs) == 1 and all(c is not None for c in chunks)
    tail = pool.alloc(16 * MiB)  # the 16 MiB no chunk fits
    assert tail is not None and tail.slab is pool._slabs[0] and len(pool._slabs) == 1
    assert pool.alloc(4096).slab is not pool._slabs[0]  # full: a new slab


def test_fragmentation_returns_none_and_empty_slabs_are_unpinned(fake_pin):
    """Two 1 GiB slabs of 16 MiB blocks with every other one freed: 1 GiB is free but no
    48 MiB run, so the pool says None (and stays usable); with every block freed its slabs are
    trimmed, torch's host cache emptied (else the dropped slabs stay pinned), and it serves."""
    pool = HostPool(capacity_bytes=2 * GiB, slab_bytes=GiB, pin=True)
    small = _fill(pool, 16 * MiB)
    assert len(small) == 128
    for block in small[::2]:
        pool.free(block)
    assert pool.alloc(CHUNK_48) is None and not fake_pin
    assert pool.used_bytes == 64 * 16 * MiB and pool.reserved_bytes == 2 * GiB
    for block in small[1::2]:
        pool.free(block)
    assert pool.trim() == 2 * GiB and fake_pin == [1] and pool.reserved_bytes == 0
    assert pool.alloc(CHUNK_48) is not None and pool.reserved_bytes == GiB
    pool.close()
    assert fake_pin == [1, 1]


@pytest.mark.parametrize("preset", ["h200_13b_nvme", "h200_20b_bf16", "h200_13b_stream_24gib",
                                    "h200_20b_stream_80gib"])
def test_the_plan_counts_the_state_chunks_the_pinned_pool_holds(fake_pin, preset):
    """Each split preset's store replayed as its run fills it (the streamed weights' pages, the
    rings, the NVMe staging, then state chunks until the pool refuses one): the pool pins at
    most ``cpu_bytes`` and holds the plan's RAM chunks to within 2. Counting bytes instead (the
    plan before power-of-two slabs) says 1,700 chunks of 48 MiB for the 13B NVMe preset; its
    pool holds 1,674."""
    from _examples import ROOT, load_example
    from tiermem.apps.plan.streaming import block_numels
    from tiermem.optim.layout import GRAD_SLOTS, NVME_EXTRA_CHUNKS, OUT_SLOTS, state_numel

    module = load_example("train_large", "train_large_pool_replay")
    cfg = module.load(str(ROOT / "examples" / "configs" / "large" / f"{preset}.yaml"))
    plan = module.make_plan(cfg)
    store, opt, model = cfg["store"], cfg["optimizer"], cfg["model"]
    chunk = 4 * state_numel(opt.chunk_numel, getattr(torch, opt.moments_dtype))
    item = next(i for i in plan.items if i.name == "optimizer state, offloaded")
    pool = HostPool(store.cpu_bytes, store.pool_slab_bytes, pin=True)
    for _ in plan.stream.streamed if plan.stream is not None else ():
        for numel in block_numels(d_model=model.d_model, mlp_ratio=model.mlp_ratio):
            assert pool.alloc(2 * numel) is not None  # bf16 weights
    for slots in (GRAD_SLOTS, OUT_SLOTS):
        assert pool.alloc(slots * opt.chunk_numel * 2) is not None
    for _ in range(opt.nvme_lookahead_chunks + NVME_EXTRA_CHUNKS):
        assert pool.alloc(chunk) is not None
    held = len(_fill(pool, chunk))
    assert _pinned_sum(pool) <= store.cpu_bytes
    assert abs(held - item.host // chunk) <= 2, (held, item.host // chunk)


def test_a_block_whose_pinned_slab_exceeds_the_budget_is_refused_at_once(fake_pin, tmp_path):
    """A 68 KiB tensor in a pinned 96 KiB pool needs a 128 KiB slab: no eviction can make
    room, so the store refuses it at once, naming the budget and the slab, and spills nothing
    to make room in vain. Red on the old code: the pool cut it a 68 KiB slab (pinning 128 KiB),
    and the budget check judged pages only, so 'small' went to NVMe first."""
    from tiermem import StoreConfig, TierFullError, TierStore

    store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=96 * KiB, nvme_bytes=1 << 20,
                                  nvme_dir=str(tmp_path), pool_slab_bytes=64 * KiB,
                                  device="cpu"))
    try:
        store._pool = HostPool(96 * KiB, 64 * KiB, pin=True)  # as a CUDA store cuts it
        store.put("small", torch.ones(4 * KiB, dtype=torch.uint8), tier="cpu")
        with pytest.raises(TierFullError, match=r"power of two: 131072, Note \[slab tail\]"):
            store.put("big", torch.ones(68 * KiB, dtype=torch.uint8), tier="cpu")
        assert store.tier_of("small") == "cpu" and _pinned_sum(store._pool) <= 96 * KiB
        assert store.put("fits", torch.ones(60 * KiB, dtype=torch.uint8), tier="cpu") is None
    finally:
        store.close()


_BY_BYTES = pytest.mark.xfail(
    strict=True, reason="tiermem/optim/layout.py private_store still sizes its pool by bytes "
    "(cpu_bytes = state + rings + 2 chunks, slabs of whole chunks rounded down to a power of "
    "two when pinned): the fix is in poolpin's report; drop this mark with it")


@pytest.mark.parametrize("chunk_numel,moments,count", [
    pytest.param(1 << 24, torch.float32, 80, marks=_BY_BYTES),
    pytest.param(1 << 22, torch.float32, 320, marks=_BY_BYTES),
    (1 << 22, torch.bfloat16, 320)])  # 32 MiB chunks: power-of-two slabs hold them exactly
def test_hybrid_adams_private_store_holds_its_chunks_when_pinned(fake_pin, monkeypatch,
                                                                 chunk_numel, moments, count):
    """HybridAdam without a store makes one sized for its state (``private_store``); on CUDA
    its pool is pinned, so it must hold the rings and every chunk in power-of-two slabs. By
    bytes it holds 61 of 80 chunks of 192 MiB (1.34B-like, fp32 moments) and 301 of 320 of
    48 MiB: HybridAdam(state_tier="cpu") would fail with TierFullError on the GPU."""
    import tiermem.store.store as store_mod
    from tiermem.optim.layout import GRAD_SLOTS, OUT_SLOTS, chunk_state_bytes, private_store

    monkeypatch.setattr(store_mod, "HostPool", lambda cap, slab, pin: HostPool(cap, slab, True))
    groups = [SimpleNamespace(plan=SimpleNamespace(chunks=[SimpleNamespace(numel=chunk_numel)]
                                                   * count), sizes=[2])]
    store = private_store(groups, chunk_numel=chunk_numel, moments_dtype=moments,
                          lookahead_chunks=2, state_tier="cpu", device=torch.device("cpu"),
                          nvme_dir=None)
    try:
        pool = store._pool
        assert pool.alloc(GRAD_SLOTS * chunk_numel * 2) and pool.alloc(OUT_SLOTS * chunk_numel * 2)
        held = 0
        while held < count and pool.alloc(chunk_state_bytes(chunk_numel, moments)) is not None:
            held += 1
        assert held == count
    finally:
        store.close()


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 300 * KiB), min_size=1, max_size=40),
       slab_pages=st.integers(1, 64), pin=st.booleans())
def test_pool_room_for_holds_exactly_what_it_was_sized_for(sizes, slab_pages, pin):
    """A pool of ``pool_room_for(sizes)`` serves every one of ``sizes`` in order (replayed with
    meta tensors), pinning no more than that capacity."""
    real = pool_mod.torch
    pool_mod.torch = SimpleNamespace(
        empty=lambda n, dtype, pin_memory=False: real.empty(n, dtype=dtype, device="meta"),
        uint8=real.uint8, accelerator=SimpleNamespace(empty_host_cache=lambda: None))
    try:
        room = pool_mod.pool_room_for(sizes, slab_pages * 4096, pin)
        pool = HostPool(room, slab_pages * 4096, pin=pin)
        assert all(pool.alloc(n) is not None for n in sizes)
        assert pool.reserved_bytes <= room and (not pin or _pinned_sum(pool) <= room)
    finally:
        pool_mod.torch = real


def test_pool_room_for_a_13b_blocks_weights():
    """The 13B stream preset's 28 streamed blocks of weights (150, 50, 200, 200 MiB and small
    tensors, 16.41 GiB of pages) need 17.0 GiB of pinned 1 GiB slabs (their tails fit no more
    weights: the preset's state chunks fill them) and 16.43 GiB of pageable ones; in slabs of
    the largest weight, 200 MiB (rounded down to 128 MiB pinned, each 150/200 MiB weight in a
    slab of 256 MiB), 21.1 GiB: "the weights plus one slab" is no budget for a pinned pool."""
    from tiermem.apps.plan.streaming import block_numels

    numels = block_numels(d_model=5120, mlp_ratio=4)
    sizes = [2 * n for _ in range(28) for n in numels]
    pages = sum(pool_mod.block_bytes(n) for n in sizes)
    assert round(pages / GiB, 2) == 16.41
    assert pool_mod.pool_room_for(sizes, GiB) == 17 * GiB
    assert round(pool_mod.pool_room_for(sizes, GiB, pin=False) / GiB, 2) == 16.43
    assert pool_mod.pool_room_for(sizes, 200 * MiB) == 21 * GiB + 128 * MiB


def test_pageable_pools_flush_no_host_cache(fake_pin):
    pool = HostPool(capacity_bytes=64 * KiB, slab_bytes=64 * KiB, pin=False)
    pool.free(pool.alloc(4096))
    pool.trim()
    pool.close()
    assert fake_pin == []
