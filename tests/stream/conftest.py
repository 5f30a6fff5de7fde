"""Set-up the weight-streaming tests share: CPU stores with small budgets
(:func:`make_stream_store`) and the plain one without an NVMe tier (:func:`store`)."""

from __future__ import annotations

import pytest

from tiermem import StoreConfig, TierStore


@pytest.fixture
def make_stream_store(tmp_path):
    """Factory of CPU stores, closed when the test ends: ``StoreConfig(device="cpu",
    gpu_bytes=1 MiB, cpu_bytes=16 MiB, pool_slab_bytes=1 MiB)`` changed by its keywords; with
    ``nvme_bytes`` each store gets a spill directory of its own under ``tmp_path`` and posix I/O
    on 2 threads (unless given)."""
    made = []

    def make(**kw) -> TierStore:
        kw = {"device": "cpu", "gpu_bytes": 1 << 20, "cpu_bytes": 16 << 20,
              "pool_slab_bytes": 1 << 20, **kw}
        if kw.get("nvme_bytes"):
            spill = tmp_path / f"s{len(made)}"
            spill.mkdir()
            kw = {"nvme_dir": str(spill), "io_backend": "posix", "io_threads": 2, **kw}
        s = TierStore(StoreConfig(**kw))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(make_stream_store):
    """A CPU store without an NVMe tier: 1 MiB GPU budget, 16 MiB RAM (a test file that needs
    other budgets defines its own ``store`` through :func:`make_stream_store`)."""
    return make_stream_store()
