"""Issue 16.3/16.4: a TierStore or a HybridAdam dropped without close() frees everything it
made: spill directories, descriptors, threads and mappings."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierStore
from tiermem.optim import HybridAdam
from tiermem.store.io import reaper


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _usage(root, initial: set) -> dict:
    """Threads, descriptors and spill dirs once the dropped objects' finalizers are done.

    The last reference to a store may be dropped inside an I/O callback or a collection; its
    finalizer then queues the backend's shutdown to the reaper (Note [finalizer teardown]: one
    daemon thread per process, started by the first backend, so not waited for). Waiting
    (bounded) for the other threads started since ``initial`` to end lets that finish; a leaked
    thread never ends, and the comparison that follows fails."""
    deadline = time.monotonic() + 30
    while True:
        gc.collect()
        assert reaper.wait_idle(30), "the reaper did not finish the queued teardown in 30 s"
        alive = [t for t in threading.enumerate()
                 if t not in initial and t.name != "tiermem-reaper"]
        if not alive or time.monotonic() > deadline:
            break
        alive[0].join(0.1)
    return dict(threads=threading.active_count(), fds=_fds(), dirs=len(os.listdir(root)))


@pytest.mark.parametrize("backend", ["aiofiles", "posix"])
def test_a_dropped_store_frees_its_threads_descriptors_and_directory(tmp_path, backend):
    def use_and_drop():
        store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=1 << 20, nvme_bytes=1 << 20,
                                      nvme_dir=str(tmp_path), io_backend=backend, io_threads=2,
                                      o_direct=False))
        for i in range(3):
            store.put(i, torch.full((2000,), float(i)), tier="nvme")
        assert torch.equal(store.get(1, "cpu"), torch.full((2000,), 1.0))
        return weakref.ref(store)

    initial = set(threading.enumerate())
    for _ in range(10):  # warm-up: imports, and malloc's per-thread arenas (a few, reused)
        use_and_drop()
    before, maps = _usage(tmp_path, initial), _maps()
    refs = [use_and_drop() for _ in range(20)]
    after = _usage(tmp_path, initial)
    assert all(r() is None for r in refs)
    assert after == before  # no thread, descriptor or spill directory left behind
    assert _maps() < maps + 10  # not a thread stack and guard page per dropped store


def _train_and_drop(tmp_path, **kw):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=0.5, state_tier="nvme",
                     nvme_dir=str(tmp_path), chunk_numel=4096, **kw)
    for step in range(2):
        _, loss = model(*make_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()  # param_sync="forward": the worker holds it until the step is done
    return model, weakref.ref(opt)


@pytest.mark.parametrize("param_sync", ["step", "forward"])
def test_a_dropped_hybrid_adam_frees_its_worker_store_and_hooks(tmp_path, param_sync):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        initial = set(threading.enumerate())
        _train_and_drop(tmp_path, param_sync=param_sync)  # warm-up: imports, lazy pools
        before = _usage(tmp_path, initial)
        kept = [_train_and_drop(tmp_path, param_sync=param_sync) for _ in range(4)]
        after = _usage(tmp_path, initial)
        assert [ref() for _, ref in kept] == [None] * 4  # collected although the model lives
        assert after == before  # worker threads, I/O threads, descriptors and spill dirs gone
        model = kept[-1][0]
        _, loss = model(*make_batch(0))  # its hooks are inert: training without it works
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        torch.set_num_threads(threads)


_COLLECT_UNDER_THREADING_LOCK = """
import gc, os, sys, threading, time
import torch
from tiermem import StoreConfig, TierStore

spill, backend = sys.argv[1], sys.argv[2]
store = TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=1 << 20, nvme_bytes=1 << 20, nvme_dir=spill,
                              io_backend=backend, io_threads=2, o_direct=False))
for i in range(3):
    store.put(i, torch.full((2000,), float(i)), tier="nvme")
assert torch.equal(store.get(1, "cpu"), torch.full((2000,), 1.0))
cycle = [store]
cycle.append(cycle)  # only a collection frees the store now
del store, cycle

def collect_as_a_starting_thread_would():  # Thread._set_tstate_lock holds this lock
    with threading._shutdown_locks_lock:
        gc.collect()

t = threading.Thread(target=collect_as_a_starting_thread_would, daemon=True)
t.start()
t.join(20)
print("collection returned" if not t.is_alive() else "collection hung", flush=True)
deadline = time.monotonic() + 20
while os.listdir(spill) and time.monotonic() < deadline:
    time.sleep(0.05)
print("spill left" if os.listdir(spill) else "spill removed", flush=True)
os._exit(0)
"""


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"),
                    reason="this Python's threading has no _shutdown_locks_lock")
@pytest.mark.parametrize("backend", ["aiofiles", "posix"])
def test_a_store_collected_under_threadings_own_lock_neither_hangs_nor_leaks(tmp_path, backend):
    """Note [finalizer teardown]: a collection can run a dropped store's finalizer on a thread
    that holds threading's _shutdown_locks_lock (a thread being started); joining the store's
    I/O threads there waited forever (seen once in a clean-clone run of the suite). Now the
    teardown goes to the reaper: the collection returns, and the spill directory is still
    removed. In a subprocess, so a hang fails this test instead of the session."""
    import subprocess
    import sys

    spill = tmp_path / "spill"
    spill.mkdir()
    out = subprocess.run([sys.executable, "-c", _COLLECT_UNDER_THREADING_LOCK, str(spill), backend],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["collection returned", "spill removed"], \
        (out.stdout, out.stderr[-2000:])
