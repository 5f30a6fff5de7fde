"""Disk faults seen through the TierStore: ENOSPC (injected and real), EIO, short reads, a
truncated or bit-flipped spill file, a slow disk. Nothing may be lost or returned corrupted."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
import warnings

import pytest
import torch

import tiermem.store.io.posix as posix_mod
from _faults import EIO, ENOSPC, FaultBackend, check_budgets, install_backend, rand, small_store
from tiermem import TierFullError
from tiermem.store.nvme import SpillCorruption, SpillError


@pytest.fixture
def faulty(monkeypatch, tmp_path):
    """``make(**backend_kw, **store_kw)`` -> (store, backend); both closed at the end."""
    made = []

    def make(backend_kw=None, **store_kw):
        backend = FaultBackend(**(backend_kw or {}))
        install_backend(monkeypatch, backend)
        store = small_store(tmp_path, **store_kw)
        made.append((store, backend))
        return store, backend

    yield make
    for store, backend in made:
        store.close()
        backend.shutdown()


def spill_path(store):
    return store._spill.path


# ------------------------------------------------------------------------------ ENOSPC (injected)


def test_enospc_on_put_to_nvme_keeps_the_tensor_in_cpu_with_a_warning(faulty):
    store, backend = faulty(dict(write_errno=ENOSPC))
    x = rand(3000)
    with pytest.warns(RuntimeWarning, match=r"spilling 'k' failed .*No space left on device.*"
                                            r"stays in the cpu tier") as rec:
        store.put("k", x, tier="nvme")
        store.synchronize()
    msg = str(rec[0].message)
    assert spill_path(store) in msg and "offset=0" in msg  # names the file and the offset
    assert backend.failed_writes == 1  # ENOSPC is never retried
    assert store.tier_of("k") == "cpu"
    assert store.used_bytes("nvme") == 0  # the failed extent was given back
    assert torch.equal(store.get("k", "cpu"), x)
    check_budgets(store)


def test_enospc_on_evict_reports_it_on_the_future_and_keeps_the_bytes(faulty):
    store, backend = faulty(dict(write_errno=ENOSPC, fail_writes=1))
    x = rand(5000, seed=1)
    store.put("k", x, tier="cpu")
    fut = store.evict("k", "nvme")
    with pytest.raises(SpillError, match="No space left on device") as info:
        fut.wait()
    assert info.value.errno == errno.ENOSPC and info.value.key == "k"
    assert info.value.path == spill_path(store) and info.value.offset == 0
    with pytest.warns(RuntimeWarning, match="stays in the cpu tier"):
        store.synchronize()
    assert store.tier_of("k") == "cpu"
    assert torch.equal(store.get("k", "cpu"), x)
    # the disk has room again: the same key spills and comes back intact
    store.evict("k", "nvme").wait()
    store.synchronize()
    assert store.tier_of("k") == "nvme"
    assert torch.equal(store.get("k", "cpu"), x)


def test_enospc_while_evicting_victims_fails_the_put_clearly_and_loses_nothing(faulty):
    store, _ = faulty(dict(write_errno=ENOSPC), gpu_bytes=0, cpu_bytes=16 << 10)
    xs = {i: rand(1000, seed=i) for i in range(4)}  # 4 KiB blocks: the cpu tier is full
    for i, x in xs.items():
        store.put(i, x, tier="cpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with pytest.raises(TierFullError, match=r"put\('new'\): 4000 bytes fit in no tier: .*cpu "
                                                r"tier: no room .*spilling \d+ failed .*No space "
                                                r"left on device.*raise a budget") as info:
            store.put("new", rand(1000, seed=9))
    assert "held" not in str(info.value)  # nothing is held: the failed spills blocked it
    assert any("No space left on device" in str(w.message) for w in rec)
    assert "new" not in store
    for i, x in xs.items():  # every victim whose spill failed is still in cpu, intact
        assert store.tier_of(i) == "cpu"
        assert torch.equal(store.get(i, "cpu"), x)
    check_budgets(store)


def test_keys_whose_spill_failed_become_victims_again_once_the_disk_has_room(faulty):
    store, backend = faulty(dict(write_errno=ENOSPC), gpu_bytes=0, cpu_bytes=16 << 10)
    xs = {i: rand(1000, seed=i) for i in range(4)}
    for i, x in xs.items():
        store.put(i, x, tier="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TierFullError):
            store.put("new", rand(1000, seed=9))
    backend.write_errno = None  # space was freed on the disk
    store.put("new", rand(1000, seed=9), tier="cpu")  # must spill an old key now
    assert sum(store.tier_of(i) == "nvme" for i in xs) == 1
    for i, x in xs.items():
        assert torch.equal(store.get(i, "cpu"), x)


def test_transient_eio_on_write_is_retried_persistent_eio_keeps_the_tensor(faulty):
    store, backend = faulty(dict(write_errno=EIO, fail_writes=1))
    x = rand(3000, seed=13)
    store.put("k", x, tier="nvme")
    store.synchronize()  # no warning: the positional write was simply repeated
    assert store.tier_of("k") == "nvme" and backend.failed_writes == 1
    assert torch.equal(store.get("k", "cpu"), x)
    backend.write_errno, backend.writes_left = EIO, 1 << 60
    with pytest.warns(RuntimeWarning, match="spilling 'j' failed .*Input/output error"):
        store.put("j", x, tier="nvme")
        store.synchronize()
    assert store.tier_of("j") == "cpu" and torch.equal(store.get("j", "cpu"), x)


# ------------------------------------------------------------------------------ ENOSPC (real fs)


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs mounted for the test (needs root; skipped where mount is not allowed)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_enospc_on_a_full_tmpfs(tiny_fs):
    store = small_store(tiny_fs, gpu_bytes=0, cpu_bytes=4 << 20, nvme_bytes=4 << 20,
                        pool_slab_bytes=1 << 20, io_chunk_bytes=64 << 10)
    try:
        xs = {i: rand(64 << 10, seed=i) for i in range(8)}  # 8 x 256 KiB into a 1 MiB disk
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for i, x in xs.items():
                store.put(i, x, tier="nvme")
                store.synchronize()
        tiers = {i: store.tier_of(i) for i in xs}
        assert "nvme" in tiers.values() and "cpu" in tiers.values(), tiers
        full = [w for w in rec if "No space left on device" in str(w.message)]
        assert len(full) == list(tiers.values()).count("cpu")
        first = str(full[0].message)
        assert str(tiny_fs) in first and "stays in the cpu tier" in first
        for i, x in xs.items():  # nothing lost, wherever it ended up
            assert torch.equal(store.get(i, "cpu"), x)
            if tiers[i] == "nvme":
                store.evict(i, "nvme").wait()
        check_budgets(store)
        # free a spilled key: its extent (already allocated on disk) takes a stranded one
        spilled = [i for i in xs if tiers[i] == "nvme"]
        stranded = [i for i in xs if tiers[i] == "cpu"]
        store.delete(spilled[0])
        store.evict(stranded[0], "nvme").wait()
        store.synchronize()
        assert store.tier_of(stranded[0]) == "nvme"
        assert torch.equal(store.get(stranded[0], "cpu"), xs[stranded[0]])
    finally:
        store.close()
    assert os.listdir(tiny_fs) == []


def test_real_enospc_during_a_checkpoint_keeps_the_previous_one(tiny_fs):
    from tiermem.checkpoint import load_checkpoint, save_checkpoint

    path = tiny_fs / "ckpt.pt"
    save_checkpoint(path, extra={"w": torch.ones(1000)})
    with pytest.raises(OSError, match="No space left on device") as info:
        save_checkpoint(path, extra={"w": torch.zeros(1 << 19)})  # 2 MiB into 1 MiB
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert torch.equal(load_checkpoint(path)["extra"]["w"], torch.ones(1000))
    assert os.listdir(tiny_fs) == ["ckpt.pt"]  # the temporary file was removed


# ------------------------------------------------------------------------------ EIO, short reads


def test_transient_eio_on_read_is_retried_and_the_data_returned(faulty):
    store, backend = faulty(dict(read_errno=EIO, fail_reads=1))
    x = rand(3000, seed=2)
    store.put("k", x, tier="nvme")
    store.synchronize()
    assert torch.equal(store.get("k"), x)
    assert backend.failed_reads == 1 and backend.reads == 2


def test_persistent_eio_names_key_file_and_offset_and_the_key_survives(faulty):
    store, backend = faulty(dict(read_errno=EIO), io_chunk_bytes=4096)
    x = rand(3000, seed=3)
    store.put("k", x, tier="nvme")
    store.synchronize()
    with pytest.raises(SpillError, match="Input/output error") as info:
        store.get("k")
    err = info.value
    assert err.errno == errno.EIO and err.key == "k"
    assert err.path == spill_path(store) and err.offset == 0
    assert "key='k'" in str(err) and spill_path(store) in str(err) and "offset=0" in str(err)
    assert backend.failed_reads >= 3  # a chunk was tried 1 + io_retries(2) times
    assert store.tier_of("k") == "nvme"  # still spilled; the staging memory was given back
    assert store.used_bytes("cpu") == 0 and store.used_bytes("gpu") == 0
    with pytest.raises(SpillError, match="Input/output error"):
        store.prefetch("k", "cpu").wait()
    backend.read_errno = None  # the disk recovers: nothing was lost
    assert torch.equal(store.get("k"), x)


def test_short_reads_and_writes_are_completed(faulty, monkeypatch):
    real_pwritev, real_preadv, calls = os.pwritev, os.preadv, {"w": 0, "r": 0}

    def half_pwritev(fd, bufs, offset):  # the kernel may move fewer bytes than asked
        calls["w"] += 1
        view = memoryview(bufs[0]).cast("B")
        return real_pwritev(fd, [view[:max(1, view.nbytes // 2)]], offset)

    def half_preadv(fd, bufs, offset):
        calls["r"] += 1
        view = memoryview(bufs[0]).cast("B")
        return real_preadv(fd, [view[:max(1, view.nbytes // 2)]], offset)

    monkeypatch.setattr(posix_mod.os, "pwritev", half_pwritev)
    monkeypatch.setattr(posix_mod.os, "preadv", half_preadv)
    store, _ = faulty()
    x = rand(5000, seed=4)
    store.put("k", x, tier="nvme")
    store.synchronize()
    assert torch.equal(store.get("k"), x)
    assert calls["w"] > 2 and calls["r"] > 2


def test_read_hitting_eof_once_is_retried(faulty, monkeypatch):
    real_preadv, left = os.preadv, [1]

    def eof_once(fd, bufs, offset):
        if left[0]:
            left[0] -= 1
            return 0  # end of file: a read racing a truncation
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(posix_mod.os, "preadv", eof_once)
    store, _ = faulty()
    x = rand(2000, seed=5)
    store.put("k", x, tier="nvme")
    store.synchronize()
    assert torch.equal(store.get("k"), x)


# ------------------------------------------------------------------------------ corruption


def test_truncated_spill_file_raises_spill_corruption_never_data(faulty):
    store, _ = faulty(io_chunk_bytes=4096)
    x, y = rand(1000, seed=6), rand(3000, seed=7)  # extents [0, 4096) and [4096, 16384)
    store.put("a", x, tier="nvme")
    store.put("b", y, tier="nvme")
    store.synchronize()
    os.truncate(spill_path(store), 4096 + 100)  # "a" whole, "b" cut short
    assert torch.equal(store.get("a"), x)
    with pytest.raises(SpillCorruption, match="truncated") as info:
        store.get("b")
    assert info.value.key == "b" and info.value.path == spill_path(store)
    assert info.value.offset == 4096 + 100
    assert store.tier_of("b") == "nvme"
    with pytest.raises(SpillCorruption):
        store.get("b", "cpu")  # asking again does not return the half-read buffer


@pytest.mark.parametrize("where", ["first_chunk", "last_chunk", "tail_byte"])
def test_bit_flip_in_any_chunk_raises_spill_corruption(faulty, where):
    store, _ = faulty(io_chunk_bytes=4096)
    x = rand(5000, seed=8)  # 20000 bytes: 5 chunks of 4 KiB
    store.put("k", x, tier="nvme")
    store.synchronize()
    pos = {"first_chunk": 5, "last_chunk": 4 * 4096 + 7, "tail_byte": 19999}[where]
    with open(spill_path(store), "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))
    fut = store.prefetch("k", "gpu")
    with pytest.raises(SpillCorruption, match="mismatch") as info:
        fut.wait()
    assert info.value.offset == pos // 4096 * 4096  # the bad chunk's offset
    with pytest.raises(SpillCorruption):
        store.get("k")
    assert store.tier_of("k") == "nvme"
    store.delete("k")  # a corrupted key can still be dropped
    check_budgets(store)
    assert store.used_bytes("nvme") == 0


# ------------------------------------------------------------------------------ slow disk


def test_slow_disk_only_slows_things_down(faulty):
    store, backend = faulty(dict(delay_s=0.005), gpu_bytes=32 << 10, cpu_bytes=32 << 10)
    xs = {i: rand(1500, seed=i) for i in range(12)}
    t0 = time.perf_counter()
    for i, x in xs.items():
        store.put(i, x, tier="nvme")
    errors = []

    def reader(keys):
        try:
            for i in keys:
                with store.hold(i, "cpu") as t:
                    assert torch.equal(t, xs[i])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    # readers hold odd keys while this thread prefetches even ones (a held key must not be
    # promoted by another thread: see test_a_held_key_is_not_moved_by_another_get)
    threads = [threading.Thread(target=reader, args=(list(xs)[j::4],)) for j in (1, 3)]
    for t in threads:
        t.start()
    for i in list(xs)[::2]:
        store.prefetch(i, "gpu")
    for t in threads:
        t.join()
    assert not errors
    for i, x in xs.items():
        assert torch.equal(store.get(i), x)
    store.synchronize()
    elapsed = time.perf_counter() - t0
    assert backend.writes >= 12 and backend.reads >= 1
    assert elapsed >= 0.005 * (backend.writes + backend.reads) / backend.threads * 0.9
    check_budgets(store)


# ------------------------------------------------------------------------------ holds


def test_a_held_key_is_not_moved_by_another_get(faulty):
    store, _ = faulty()
    x = rand(1000, seed=11)
    store.put("k", x, tier="cpu")
    held = store.get("k", "cpu", hold=True)
    store.prefetch("k", "gpu")          # e.g. a prefetcher thread
    store.put("other", rand(1000, seed=12), tier="cpu")
    assert torch.equal(held, x)
    store.release("k")
