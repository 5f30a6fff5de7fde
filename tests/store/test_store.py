"""TierStore on the CPU: tier transitions, budgets, eviction, errors, threads, asyncio."""

import asyncio
import pathlib
import random
import threading

import pytest
import torch

from tiermem import StoreConfig, TierFullError, TierStore
from tiermem.store import StoreClosedError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.float64, torch.complex64]


def rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def check_budgets(store):
    for tier in ("gpu", "cpu", "nvme"):
        assert store.used_bytes(tier) <= store.config.budget(tier), tier


@pytest.mark.parametrize("src,dst", [("gpu", "cpu"), ("gpu", "nvme"), ("cpu", "nvme")])
def test_every_transition_down_and_up(make_store, src, dst):
    store = make_store()
    x = rand((33, 17), seed=1)
    store.put("k", x, tier=src)
    assert store.tier_of("k") == src
    store.evict("k", dst).wait()
    assert store.tier_of("k") == dst
    if dst == "nvme":
        store.prefetch("k", "cpu").wait()
        assert store.tier_of("k") == "cpu"
        assert torch.equal(store.get("k", "cpu"), x)
        store.evict("k", "nvme").wait()
    out = store.get("k")
    assert store.tier_of("k") == "gpu"
    assert out.device == store.device and torch.equal(out, x)
    check_budgets(store)


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_odd_shapes_round_trip_exactly(make_store, tier, dtype):
    store = make_store()
    for i, shape in enumerate([(), (1,), (7,), (4097,), (3, 5, 7), (0, 4)]):
        x = rand(shape, dtype, seed=i)
        store.put(("t", i), x, tier=tier)
        assert store.tier_of(("t", i)) == tier
        y = store.get(("t", i), "cpu" if tier != "gpu" else "gpu")
        assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)


def test_non_contiguous_input_is_stored_contiguous(make_store):
    store = make_store()
    x = rand((64, 32)).t()[::2]
    assert not x.is_contiguous()
    store.put("nc", x, tier="nvme")
    assert torch.equal(store.get("nc"), x)


def test_put_copies_views_and_keeps_owned_device_tensor_by_reference(make_store):
    store = make_store()
    base = rand((100,))
    store.put("view", base[10:20], tier="gpu")  # a view of a bigger storage is copied
    base[10:20] = 0
    assert not torch.equal(store.get("view"), base[10:20])
    own = rand((10,))
    store.put("own", own, tier="gpu")
    assert store.get("own").data_ptr() == own.data_ptr()


def test_full_tier_evicts_lru_victims_down(make_store):
    store = make_store(gpu_bytes=4096 * 4, cpu_bytes=4096 * 4)
    xs = [rand((1024,), seed=i) for i in range(12)]  # 4 KiB each
    for i, x in enumerate(xs):
        store.put(i, x)
        check_budgets(store)
    assert [store.tier_of(i) for i in range(12)] == ["nvme"] * 4 + ["cpu"] * 4 + ["gpu"] * 4
    store.get(0)  # brings 0 up; the least recently used gpu key (4... no: 8) moves down
    assert store.tier_of(0) == "gpu" and store.tier_of(8) == "cpu"
    for i, x in enumerate(xs):
        assert torch.equal(store.get(i), x)
        check_budgets(store)
    s = store.stats()
    assert s["moved_bytes"]["gpu->cpu"] > 0 and s["moved_bytes"]["cpu->nvme"] > 0
    assert s["moved_bytes"]["nvme->gpu"] > 0


def test_held_key_is_never_evicted(make_store):
    store = make_store(gpu_bytes=8192, cpu_bytes=4096, nvme_bytes=0, nvme_dir=None)
    store.put("a", rand((1024,)), tier="gpu")
    with store.hold("a") as a:
        store.put("b", rand((1024,), seed=2), tier="gpu")
        store.put("c", rand((1024,), seed=3), tier="gpu")  # b goes down, a is held
        assert store.tier_of("b") == "cpu"
        with pytest.raises(TierFullError, match="no room"):
            store.put("d", rand((1024,), seed=4), tier="gpu")  # c cannot go down: cpu full
        assert store.tier_of("a") == "gpu" and store.tier_of("c") == "gpu"
        assert a.data_ptr() == store.get("a").data_ptr()
        with pytest.raises(ValueError, match="held by a caller"):
            store.evict("a", "cpu")
        with pytest.raises(ValueError, match="held by a caller"):
            store.delete("a")
    store.delete("b")
    store.evict("a", "cpu").wait()
    with pytest.raises(ValueError, match="not held"):
        store.release("a")


def test_fits_nowhere_raises_and_loses_nothing(make_store):
    store = make_store(gpu_bytes=8192, cpu_bytes=8192, nvme_bytes=16384)
    xs = {i: rand((1024,), seed=i) for i in range(6)}
    for i, x in xs.items():
        store.put(i, x)
    with pytest.raises(TierFullError, match="fit in no tier"):
        store.put("big", rand((4096,)))
    assert "big" not in store
    for i, x in xs.items():
        assert torch.equal(store.get(i, "cpu"), x)
    with pytest.raises(TierFullError, match="no room|full"):
        for i in range(6, 12):  # fill every tier; the put that fits nowhere raises
            xs[i] = rand((1024,), seed=i)
            store.put(i, xs[i], tier="nvme")
    del xs[i]
    assert i not in store and len(store) == len(xs)
    store.delete(i - 1)  # every tier is full: make room for the swaps below
    del xs[i - 1]
    for i, x in xs.items():
        assert torch.equal(store.get(i, "cpu"), x)
    check_budgets(store)


def test_replacing_a_key_frees_the_old_value(make_store):
    store = make_store()
    store.put("k", rand((1024,)), tier="cpu")
    used = store.used_bytes("cpu")
    store.put("k", rand((2048,), seed=1), tier="nvme")
    store.synchronize()  # the staging block is freed when the write lands
    assert store.used_bytes("cpu") == used - 4096 and store.tier_of("k") == "nvme"
    store.delete("k")
    assert store.used_bytes("nvme") == 0 and len(store) == 0


def test_prefetch_returns_future_and_get_waits(make_store):
    store = make_store()
    x = rand((5000,))
    store.put("k", x, tier="nvme")
    fut = store.prefetch("k", "gpu")
    fut.wait()
    assert fut.done()
    assert store.tier_of("k") == "gpu"
    assert torch.equal(store.get("k"), x)
    assert store.prefetch("k", "cpu").done()  # already higher: nothing to do


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_budgets_and_bytes(make_store, seed):
    rng = random.Random(seed)
    store = make_store(gpu_bytes=40_000, cpu_bytes=64 << 10, nvme_bytes=256 << 10)
    truth = {}
    for step in range(400):
        op = rng.random()
        key = rng.randrange(24)
        if op < 0.35:
            n = rng.choice([1, 3, 100, 999, 4096, 5000, 9000])
            x = rand((n,), rng.choice(DTYPES[:6]), seed=step)
            try:
                store.put(key, x, tier=rng.choice([None, "gpu", "cpu", "nvme"]))
                truth[key] = x
            except TierFullError:
                assert (key in store) == (key in truth)  # a failed put keeps the old value
        elif key in truth:
            if op < 0.6:
                try:
                    y = store.get(key, rng.choice(["gpu", "cpu"]))
                    assert torch.equal(y, truth[key])
                except TierFullError:
                    pass  # every tier full of other keys: legal, and nothing may be lost
            elif op < 0.75:
                try:
                    store.prefetch(key, rng.choice(["gpu", "cpu"]))
                except TierFullError:
                    pass
            elif op < 0.9:
                tier = store.tier_of(key)
                lower = {"gpu": "cpu", "cpu": "nvme", "nvme": None}[tier]
                if lower:
                    try:
                        store.evict(key, lower)
                    except TierFullError:
                        assert store.tier_of(key) == tier
            else:
                store.delete(key)
                del truth[key]
        check_budgets(store)
    assert set(store.keys()) == set(truth)
    for key, x in truth.items():
        store.evict(key, "nvme") if store.tier_of(key) != "nvme" else None
    for key, x in truth.items():
        assert torch.equal(store.get(key, "cpu"), x)
        store.delete(key)


def test_corrupted_spill_file_is_detected_not_returned(make_store):
    store = make_store()
    store.put("k", rand((3000,)), tier="nvme")
    store.synchronize()
    path = store._spill.path
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(OSError, match="corrupted: CRC32?C? mismatch") as info:
        store.get("k")
    assert "'k'" in str(info.value) and str(path) in str(info.value) and "offset=0" in str(info.value)
    assert store.tier_of("k") == "nvme"
    store.delete("k")


@pytest.mark.parametrize("kw,match", [
    (dict(gpu_bytes=-1), "StoreConfig.gpu_bytes=-1 is negative"),
    (dict(cpu_bytes="12 parsecs"), "StoreConfig.cpu_bytes='12 parsecs' is not a byte size"),
    (dict(nvme_bytes=4096, nvme_dir=None), "needs a spill directory"),
    (dict(io_backend="tape"), "StoreConfig.io_backend='tape' is not one of"),
    (dict(io_threads=0), "io_threads=0 must be an int >= 1"),
    (dict(device="tpu"), "StoreConfig.device='tpu'"),
    (dict(policy="random"), "StoreConfig.policy='random' is not one of"),
])
def test_bad_config_is_rejected_with_the_field_named(kw, match):
    with pytest.raises(ValueError, match=match):
        StoreConfig(**kw)


def test_unwritable_spill_directory_is_rejected(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="nvme_dir"):
        TierStore(nvme_bytes=1 << 20, nvme_dir=str(blocker / "sub"))


def test_bad_calls_name_the_problem(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="tier='ssd' is unknown"):
        store.put("k", torch.ones(3), tier="ssd")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        store.put("k", [1, 2, 3])
    with pytest.raises(ValueError, match="is on meta"):
        store.put("k", torch.empty(3, device="meta"))
    with pytest.raises(KeyError, match="not in this TierStore"):
        store.get("missing")
    store.put("k", torch.ones(3), tier="cpu")
    with pytest.raises(ValueError, match="evict moves down only"):
        store.evict("k", "gpu")
    with pytest.raises(ValueError, match="get\\(tier='nvme'\\)"):
        store.get("k", "nvme")
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError, match="closed"):
        store.get("k")
    with pytest.raises(StoreClosedError, match="closed"):
        store.put("j", torch.ones(1))


def test_context_manager_removes_spill_directory(tmp_path):
    with TierStore(nvme_bytes=1 << 20, nvme_dir=str(tmp_path), cpu_bytes=1 << 20) as store:
        store.put("k", torch.ones(1000), tier="nvme")
        spill_dir = pathlib.Path(store._spill.dir_path)
        assert spill_dir.exists()
    assert not spill_dir.exists()


def test_stats_report_budgets_usage_and_stalls(make_store):
    store = make_store()
    store.put("k", rand((2048,)), tier="nvme")
    store.get("k")
    s = store.stats()
    assert s["gpu"]["used_bytes"] == 8192 and s["gpu"]["budget_bytes"] == 1 << 20
    assert s["nvme"]["stall_s"] > 0 and s["gpu"]["peak_bytes"] >= 8192
    assert s["moved_bytes"]["nvme->gpu"] == 8192


def test_threads_prefetch_while_another_gets(make_store):
    store = make_store(gpu_bytes=64 << 10, cpu_bytes=128 << 10, nvme_bytes=1 << 20)
    xs = {i: rand((2000,), seed=i) for i in range(40)}
    for i, x in xs.items():
        store.put(i, x, tier="nvme")
    errors = []

    def prefetcher():
        try:
            for i in range(40):
                store.prefetch(i, "cpu")
        except Exception as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=prefetcher)
    t.start()
    for i in range(40):
        assert torch.equal(store.get(i), xs[i])
    t.join()
    assert not errors
    for tier in ("gpu", "cpu", "nvme"):
        assert store.used_bytes(tier) <= store.config.budget(tier)


def test_asyncio_api(make_store):
    store = make_store()
    x = rand((777,))

    async def main():
        await store.aput("k", x, "nvme")
        return await store.aget("k")

    assert torch.equal(asyncio.run(main()), x)
