"""Set-up the weight-streaming tests share: CPU stores with small budgets
(:func:`make_stream_store`) and the plain one without an NVMe tier (:func:`store`)."""

from __future__ import annotations

import itertools

import pytest

from tiermem import TierStore


@pytest.fixture
def make_stream_store(make_store, tmp_path):
    """Factory of CPU stores through tests/conftest.py's ``make_store`` (closed when the test
    ends): 1 MiB GPU budget, 16 MiB RAM in 1 MiB slabs, no NVMe tier, changed by its keywords;
    with ``nvme_bytes`` each store gets a spill directory of its own under ``tmp_path`` (and
    ``make_store``'s I/O settings: posix on 2 threads, 64 KiB chunks, unless given)."""
    spills = itertools.count()

    def make(**kw) -> TierStore:
        kw = {"device": "cpu", "gpu_bytes": 1 << 20, "cpu_bytes": 16 << 20,
              "pool_slab_bytes": 1 << 20, "nvme_bytes": 0, **kw}
        if kw["nvme_bytes"]:
            spill = tmp_path / f"s{next(spills)}"
            spill.mkdir()
            kw.setdefault("nvme_dir", str(spill))
        return make_store(**kw)

    return make


@pytest.fixture
def store(make_stream_store):
    """A CPU store without an NVMe tier: 1 MiB GPU budget, 16 MiB RAM (a test file that needs
    other budgets defines its own ``store`` through :func:`make_stream_store`)."""
    return make_stream_store()
