"""Clean reads (Note [clean reads] in tiermem/store/clean.py): a key read up from NVMe by a
caller that only reads it keeps its extent, so evicting it again unchanged writes nothing.
Decisions and counts: bytes the spill space writes, the nvme tier's used bytes, the values."""

from __future__ import annotations

import torch
import pytest

from tiermem import StoreConfig, TierStore

N = 4096  # float32 elements: 16 KiB, four pages


def _store(tmp_path, nvme="256KiB", cpu="64KiB"):
    return TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=cpu, nvme_bytes=nvme,
                                 nvme_dir=str(tmp_path), pool_slab_bytes="64KiB", device="cpu"))


def _nvme(store) -> int:
    """Bytes of the nvme tier once every move has been applied."""
    store.synchronize()
    return store.used_bytes("nvme")


def _written(store) -> int:
    """Bytes the spill space has written, every write finished."""
    store.synchronize()
    return store._spill.bytes_written


def test_clean_get_then_evict_writes_nothing_and_keeps_the_value(tmp_path):
    with _store(tmp_path) as st:
        x = torch.arange(N, dtype=torch.float32)
        st.put("w", x, "nvme")
        w0 = _written(st)
        assert w0 == 4 * N
        view = st.get("w", "cpu", keep_extent=True)
        assert torch.equal(view, x)
        assert _nvme(st) == 4 * N  # the kept extent stays allocated
        st.evict("w", "nvme").wait()
        assert _written(st) == w0  # nothing written: the extent was kept
        assert st.stats()["kept_bytes"] == 4 * N
        assert st.tier_of("w") == "nvme" and st.used_bytes("cpu") == 0
        assert torch.equal(st.get("w", "cpu"), x)  # read back from the kept extent


def test_plain_get_frees_the_extent_and_the_eviction_writes(tmp_path):
    with _store(tmp_path) as st:
        x = torch.arange(N, dtype=torch.float32)
        st.put("w", x, "nvme")
        w0 = _written(st)
        view = st.get("w", "cpu")  # may be written: no kept copy
        assert _nvme(st) == 0
        view.add_(1.0)
        st.evict("w", "nvme").wait()
        assert _written(st) == 2 * w0
        assert torch.equal(st.get("w", "cpu"), x + 1.0)


def test_a_plain_get_after_a_clean_one_drops_the_kept_copy(tmp_path):
    with _store(tmp_path) as st:
        x = torch.arange(N, dtype=torch.float32)
        st.put("w", x, "nvme")
        st.get("w", "cpu", keep_extent=True)
        assert _nvme(st) == 4 * N
        view = st.get("w", "cpu")  # a writer now: the kept copy goes
        assert _nvme(st) == 0
        view.mul_(2.0)
        st.evict("w", "nvme").wait()
        assert _written(st) == 2 * 4 * N
        assert torch.equal(st.get("w", "cpu", keep_extent=True), 2.0 * x)


def test_put_replaces_and_frees_the_kept_copy(tmp_path):
    with _store(tmp_path) as st:
        st.put("w", torch.zeros(N), "nvme")
        st.get("w", "cpu", keep_extent=True)
        st.put("w", torch.ones(N), "cpu")
        assert _nvme(st) == 0
        st.evict("w", "nvme").wait()
        assert torch.equal(st.get("w", "cpu"), torch.ones(N))


def test_clean_prefetch_keeps_the_extent_a_plain_one_does_not(tmp_path):
    with _store(tmp_path) as st:
        st.put("a", torch.zeros(N), "nvme")
        st.put("b", torch.ones(N), "nvme")
        w0 = _written(st)
        st.prefetch("a", "cpu", keep_extent=True).wait()
        assert st.try_prefetch("b", "cpu", keep_extent=False) is not None
        st.synchronize()
        assert _nvme(st) == 4 * N  # a's kept, b's freed
        st.evict("a", "nvme").wait()
        st.evict("b", "nvme").wait()
        assert _written(st) == w0 + 4 * N  # only b written again


def test_lru_evictions_of_clean_keys_write_nothing(tmp_path):
    """The stream's pattern: keys read in turn through a cpu tier that holds two of them."""
    with _store(tmp_path, cpu=f"{2 * 4 * N}") as st:
        vals = [torch.full((N,), float(i)) for i in range(6)]
        for i, v in enumerate(vals):
            st.put(i, v, "nvme")
        w0 = _written(st)
        for _ in range(3):  # three passes, every key read up and evicted again
            for i, v in enumerate(vals):
                with _held(st, i) as t:
                    assert torch.equal(t, v)
        assert _written(st) == w0
        assert st.stats()["kept_bytes"] > 0


class _held:
    def __init__(self, st, key):
        self.st, self.key = st, key

    def __enter__(self):
        return self.st.get(self.key, "cpu", hold=True, keep_extent=True)

    def __exit__(self, *exc):
        self.st.release(self.key)


def test_a_full_spill_space_gives_up_kept_extents(tmp_path):
    with _store(tmp_path, nvme=f"{2 * 4 * N}") as st:
        st.put("a", torch.zeros(N), "nvme")
        st.put("b", torch.ones(N), "nvme")
        st.get("a", "cpu", keep_extent=True)
        st.get("b", "cpu", keep_extent=True)
        assert _nvme(st) == 2 * 4 * N  # full of kept copies
        st.put("c", torch.full((N,), 2.0), "nvme")  # needs room: the kept copies go
        assert st.tier_of("c") == "nvme"
        assert torch.equal(st.get("c", "cpu"), torch.full((N,), 2.0))
        assert torch.equal(st.get("a", "cpu"), torch.zeros(N))


def test_a_read_in_flight_then_a_plain_get_frees_the_extent(tmp_path):
    with _store(tmp_path) as st:
        st.put("w", torch.ones(N), "nvme")
        st.prefetch("w", "cpu", keep_extent=True)  # the read may still be in flight
        st.get("w", "cpu")  # a writer: when the read lands, its extent is freed
        st.synchronize()
        assert _nvme(st) == 0


@pytest.mark.parametrize("keep", [False, True])
def test_delete_frees_everything(tmp_path, keep):
    with _store(tmp_path) as st:
        st.put("w", torch.ones(N), "nvme")
        st.get("w", "cpu", keep_extent=keep)
        st.delete("w")
        assert _nvme(st) == 0 and st.used_bytes("cpu") == 0
