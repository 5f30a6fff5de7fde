"""Stress: several threads doing random put/get/prefetch/evict/delete on one small store.

``TIERMEM_STRESS_OPS`` sets the total number of operations (default 10^5, about 25 s on a
2-core CI machine); ``TIERMEM_STRESS_THREADS`` the number of threads (default 4).
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time

import pytest
import torch

from _faults import check_budgets, small_store
from tiermem import TierFullError
from tiermem.store.pool import block_bytes

N_OPS = int(os.environ.get("TIERMEM_STRESS_OPS", 100_000))
N_THREADS = int(os.environ.get("TIERMEM_STRESS_THREADS", 4))
N_KEYS = 48
_MASK = (1 << 31) - 1
_BASE = torch.arange(512, dtype=torch.int64)


def make_value(key: int, version: int, numel: int) -> torch.Tensor:
    """An int32 tensor that names its key and version and whose body follows from both."""
    t = ((_BASE[:numel] * (version * 2654435761 + key * 40503 + 1)) & _MASK).to(torch.int32)
    t[0], t[1], t[2] = key, version, numel
    return t


def check_value(key: int, t: torch.Tensor) -> None:
    assert t.dtype == torch.int32 and t.dim() == 1, (key, t.dtype, t.shape)
    k, version, numel = (int(v) for v in t[:3])
    assert k == key and numel == t.numel(), f"key {key}: got the header of key {k}"
    assert torch.equal(t, make_value(key, version, numel)), f"key {key} v{version}: bytes differ"


def _allowed(exc: BaseException) -> bool:
    """The documented outcomes of racing with other threads on the same keys."""
    if isinstance(exc, TierFullError):
        return True
    if isinstance(exc, KeyError):
        return "not in this TierStore" in str(exc)
    if isinstance(exc, ValueError):
        return "held by a caller" in str(exc) or "evict moves down only" in str(exc)
    return False


@pytest.mark.slow
def test_threads_random_ops_keep_bytes_and_budgets(tmp_path):
    store = small_store(tmp_path, gpu_bytes=24 << 10, cpu_bytes=48 << 10, nvme_bytes=64 << 10,
                        pool_slab_bytes=16 << 10, io_chunk_bytes=4096)
    versions = itertools.count(1)
    counts: dict[str, int] = {}
    failures: list[str] = []
    per_thread = N_OPS // N_THREADS
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        local: dict[str, int] = {}
        try:
            for _ in range(per_thread):
                key = rng.randrange(N_KEYS)
                r = rng.random()
                try:
                    if r < 0.30:
                        op = "put"
                        value = make_value(key, next(versions), rng.choice((4, 60, 300, 512)))
                        store.put(key, value, tier=rng.choice((None, "gpu", "cpu", "nvme")))
                    elif r < 0.60:
                        op = "get"
                        # held views are taken in the top tier, where no other get/prefetch
                        # can promote them (see test_a_held_key_is_not_moved_by_another_get)
                        with store.hold(key, "gpu") as t:
                            check_value(key, t)
                    elif r < 0.75:
                        op = "prefetch"
                        fut = store.prefetch(key, rng.choice(("gpu", "cpu")))
                        if rng.random() < 0.5:
                            fut.wait()
                    elif r < 0.90:
                        op = "evict"
                        store.evict(key, rng.choice(("cpu", "nvme")))
                    else:
                        op = "delete"
                        store.delete(key)
                    local[op] = local.get(op, 0) + 1
                except Exception as exc:  # noqa: BLE001  (classified just below)
                    if not _allowed(exc):
                        raise
                    name = f"{op}:{type(exc).__name__}"
                    local[name] = local.get(name, 0) + 1
                check_budgets(store)
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            failures.append(f"thread {seed}: {type(exc).__name__}: {exc}")
        with lock:
            for k, v in local.items():
                counts[k] = counts.get(k, 0) + v

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    elapsed = time.perf_counter() - t0
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    assert not failures, failures
    assert sum(counts.values()) == per_thread * N_THREADS
    for op in ("put", "get", "prefetch", "evict", "delete"):
        assert counts.get(op, 0) > 0, counts  # every kind of operation really happened
    print(f"\n{per_thread * N_THREADS} ops on {N_THREADS} threads in {elapsed:.1f} s: {counts}")

    # quiescent: the accounting matches what is stored, and every byte is right
    store.synchronize()
    check_budgets(store)
    expect = {"gpu": 0, "cpu": 0, "nvme": 0}
    for key in store.keys():
        n, tier = store.nbytes_of(key), store.tier_of(key)
        expect[tier] += n if tier == "gpu" else block_bytes(n)
    assert {t: store.used_bytes(t) for t in expect} == expect
    for key in store.keys():
        check_value(key, store.get(key, "cpu"))
        store.delete(key)
    assert [store.used_bytes(t) for t in ("gpu", "cpu", "nvme")] == [0, 0, 0]
    store.close()
