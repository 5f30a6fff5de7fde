"""Memory pressure: host (pinned) memory is bounded by ``cpu_bytes``; a request beyond it spills
to NVMe or fails with a clear TierFullError, losing nothing."""

from __future__ import annotations

import random

import pytest
import torch

from _faults import check_budgets, rand, small_store
from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierFullError, TierStore
from tiermem.offload import offload_activations


def test_put_beyond_the_host_budget_spills_older_keys_to_nvme(tmp_path):
    store = small_store(tmp_path, gpu_bytes=0, cpu_bytes=32 << 10, nvme_bytes=1 << 20)
    xs = {i: rand(2000, seed=i) for i in range(20)}  # 20 x 8 KiB into a 32 KiB host tier
    for i, x in xs.items():
        store.put(i, x)  # fastest tier with room: cpu, pushing the oldest down
        check_budgets(store)
    store.synchronize()
    tiers = [store.tier_of(i) for i in xs]
    assert tiers == ["nvme"] * 16 + ["cpu"] * 4  # LRU: the newest stay in host memory
    for i, x in xs.items():
        assert torch.equal(store.get(i, "cpu"), x)
        check_budgets(store)
    store.close()


def test_put_beyond_every_budget_fails_clearly_and_loses_nothing(tmp_path):
    store = small_store(tmp_path, gpu_bytes=8 << 10, cpu_bytes=16 << 10, nvme_bytes=16 << 10)
    xs = {i: rand(2000, seed=i) for i in range(5)}  # 5 x 8000 B: gpu 1, cpu 2, nvme 2
    for i, x in xs.items():
        store.put(i, x)
    with pytest.raises(TierFullError, match=r"put\('one more'\): 8000 bytes fit in no tier: "
                                            r".*used/budget bytes: gpu 8000/8192, cpu "
                                            r"16384/16384, nvme 16384/16384; raise a budget"):
        store.put("one more", rand(2000, seed=99))
    assert "one more" not in store and len(store) == 5
    check_budgets(store)
    # every tier is full, so reading a spilled key (it needs a cpu staging block) would raise
    # TierFullError too: check the resident keys, drop them, then read the spilled ones
    order = sorted(xs, key=lambda i: store.tier_of(i) == "nvme")
    assert sorted(store.tier_of(i) for i in order) == ["cpu", "cpu", "gpu", "nvme", "nvme"]
    for i in order[:3]:
        assert torch.equal(store.get(i, "cpu"), xs[i])
        store.delete(i)
    for i in order[3:]:
        assert torch.equal(store.get(i, "cpu"), xs[i])
    store.close()


def test_a_tensor_larger_than_the_host_budget_cannot_be_staged_to_nvme(tmp_path):
    # spills are staged through the (pinned) pool, so a tensor must fit the cpu budget to
    # reach the nvme tier; it is refused up front, without allocating anything
    store = small_store(tmp_path, gpu_bytes=0, cpu_bytes=16 << 10, nvme_bytes=1 << 20)
    store.put("small", rand(100))
    with pytest.raises(TierFullError, match=r"nvme tier: 40000 bytes for 'big' cannot be spilled "
                                            r"or read back: .*staged whole through the cpu "
                                            r"tier's pool.*StoreConfig.cpu_bytes=16384 is smaller; "
                                            r"raise cpu_bytes to at least 40960"):
        store.put("big", rand(10000), tier="nvme")
    with pytest.raises(TierFullError, match=r"fit in no tier: gpu tier: .*exceed its budget "
                                            r"StoreConfig.gpu_bytes=0; cpu tier: .*exceed its "
                                            r"budget StoreConfig.cpu_bytes=16384.*; nvme tier: .*"
                                            r"raise cpu_bytes to at least 40960"):
        store.put("big", rand(10000))  # any tier: each one's reason, not an empty one
    assert store._pool.reserved_bytes <= 16 << 10
    assert torch.equal(store.get("small", "cpu"), rand(100))
    store.close()


@pytest.mark.parametrize("seed", range(3))
def test_pool_never_reserves_more_than_cpu_bytes(tmp_path, seed):
    # a budget that is not a multiple of the slab size, sizes from 1 B to beyond a slab
    cpu_bytes, slab = 100 << 10, 24 << 10
    store = small_store(tmp_path, gpu_bytes=0, cpu_bytes=cpu_bytes, pool_slab_bytes=slab,
                        nvme_bytes=2 << 20)
    rng = random.Random(seed)
    truth, peak = {}, 0
    for step in range(600):
        key = rng.randrange(30)
        op = rng.random()
        try:
            if op < 0.5:
                n = rng.choice([1, 1000, 4096, 5000, 9000, 30000, 70000])
                x = torch.randint(0, 255, (n,), dtype=torch.uint8)
                store.put(key, x, tier=rng.choice([None, "cpu", "nvme"]))
                truth[key] = x
            elif op < 0.8 and key in truth:
                assert torch.equal(store.get(key, "cpu"), truth[key])
            elif op < 0.9 and key in truth and store.tier_of(key) == "cpu":
                store.evict(key, "nvme")
            elif key in truth:
                store.delete(key)
                del truth[key]
        except TierFullError:
            pass
        check_budgets(store)  # includes pool.reserved_bytes <= cpu_bytes
        peak = max(peak, store._pool.reserved_bytes)
    assert peak <= cpu_bytes
    for key, x in truth.items():
        assert torch.equal(store.get(key, "cpu"), x)
    store.close()


def test_activation_offload_under_a_full_store_keeps_training_exact(tmp_path):
    def run(store):
        torch.manual_seed(0)
        model = TinyGPT()
        losses = []
        for step in range(3):
            ctx = (offload_activations(model.blocks, store=store, tier="cpu")
                   if store is not None else None)
            idx, tgt = make_batch(step)
            if ctx is None:
                _, loss = model(idx, tgt)
                loss.backward()
            else:
                with ctx:
                    _, loss = model(idx, tgt)
                    loss.backward()
            losses.append(loss.item())
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        return losses, grads

    store = TierStore(StoreConfig(gpu_bytes=8 << 10, cpu_bytes=12 << 10, nvme_bytes=0,
                                  pool_slab_bytes=4096))
    with pytest.warns(RuntimeWarning, match="the store is full .*stay on the device"):
        offloaded = run(store)
    assert store._pool.reserved_bytes <= 12 << 10
    plain = run(None)
    assert offloaded[0] == plain[0]
    for a, b in zip(offloaded[1], plain[1]):
        assert torch.equal(a, b)
    store.close()
