"""TierStore on CUDA: pinned pool, side streams, event waits, prefetch overlapping compute."""

import time

import pytest
import torch

from tiermem import StoreConfig, TierStore

pytestmark = pytest.mark.cuda


@pytest.fixture
def store(tmp_path):
    s = TierStore(StoreConfig(gpu_bytes="1GiB", cpu_bytes="1GiB", nvme_bytes="256MiB",
                              nvme_dir=str(tmp_path), pool_slab_bytes="64MiB"))
    yield s
    s.close()


def test_cpu_tier_is_pinned_and_the_pool_reuses_blocks(store):
    x = torch.randn(1 << 20, device="cuda")
    store.put("a", x, tier="cpu")
    assert store.get("a", "cpu").is_pinned()
    reserved = store.stats()["pinned_bytes"]
    for i in range(20):  # same sizes again and again: no new pinned allocation
        store.put(("k", i % 3), torch.randn(1 << 20, device="cuda"), tier="cpu")
        if i % 3 == 2:
            for j in range(3):
                store.delete(("k", j))
    assert store.stats()["pinned_bytes"] == reserved


def test_d2h_waits_for_the_producer_on_the_compute_stream(store):
    src = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(50_000_000)  # the compute stream is busy for a while...
    src.add_(3.0)                  # ...before it produces the value
    store.put("x", src, tier="cpu")
    del src  # the store must not need the caller's reference (record_stream)
    assert torch.equal(store.get("x", "cpu"), torch.full((1 << 22,), 3.0))


def test_get_makes_the_consumer_wait_on_a_slow_h2d(store):
    x = torch.randn(1 << 22)
    store.put("x", x, tier="cpu")
    with torch.cuda.stream(store._copier.h2d_stream):
        torch.cuda._sleep(50_000_000)  # delay the copy stream: a missing wait would read garbage
    y = store.get("x") * 2  # consumer stream waits on the copy event, not the host
    assert torch.equal(y.cpu(), x * 2)


def test_prefetch_finishes_while_a_matmul_runs(store):
    x = torch.randn(64 << 20 >> 2)  # 64 MiB
    store.put("x", x, tier="cpu")
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(30):  # ~tens of ms of compute queued on the current stream
        a = a @ a
        a = a / a.norm()
    matmul_done = torch.cuda.Event()
    matmul_done.record()
    fut = store.prefetch("x", "gpu")  # issued after the matmuls were queued
    t0 = time.perf_counter()
    while not fut.done():
        assert time.perf_counter() - t0 < 10
    assert not matmul_done.query(), "the prefetch waited for the compute stream"
    torch.cuda.synchronize()
    assert torch.equal(store.get("x").cpu(), x)


def test_evict_and_spill_from_the_device_round_trip(store):
    x = torch.randn(3, 1_000_001, device="cuda").to(torch.bfloat16)
    store.put("x", x, tier="gpu")
    store.evict("x", "nvme").wait()
    assert store.tier_of("x") == "nvme"
    assert torch.equal(store.get("x"), x)
    assert store.tier_of("x") == "gpu"
    stats = store.stats()
    assert stats["moved_bytes"]["gpu->cpu"] >= x.numel() * 2
    assert stats["moved_bytes"]["nvme->gpu"] == x.numel() * 2


def test_reaped_reload_is_not_overwritten(store):
    # Note [reaped reload]: a reload whose copy landed (and was reaped) before get() must still
    # be marked as used by the consumer, or freeing it lets the next reload overwrite it while
    # the consumer's kernels are queued
    a = torch.randn(1 << 22)
    b = torch.randn(1 << 22)
    store.put("a", a, tier="cpu")
    store.put("b", b, tier="cpu")
    store.prefetch("a", "gpu").wait()
    x = store.get("a")  # get() reaps the landed move first: no move is pending here
    torch.cuda._sleep(100_000_000)  # the consumer is busy before it reads x
    out = x * 1.0
    del x
    store.delete("a")  # the host frees a's buffer while `out` is still queued
    store.prefetch("b", "gpu")  # may reuse a's memory on the H2D stream
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), a)
    assert torch.equal(store.get("b").cpu(), b)
