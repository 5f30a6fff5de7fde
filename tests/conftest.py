"""Shared fixtures: a small store per test, the CUDA skip marker, and CPU tests kept on the CPU.

Note [CPU tests on a CUDA host]: a test not marked ``cuda`` is written for CI's machine, which
has no GPU, and relies on ``device="auto"`` (StoreConfig, HybridAdam's private store, the
offload context) meaning the CPU. On the GPU machine ``auto`` means CUDA, and such tests built
a CUDA store for CPU models (tests/optim's test_store_checks and four more failed there with
torch 2.11 on an H200). An autouse fixture hides CUDA from every test without the ``cuda``
mark, so the CPU suite tests the same thing on both machines; the CUDA paths are the ``cuda``
tests' to cover."""

import os

# Note [passive OpenMP waits in tests]: README's test command runs two pytest-xdist workers on
# CI's two cores, so each worker's OpenMP threads (torch's and the native CPU Adam's) share the
# cores with the other's; OpenMP's default spin-wait then burns the time slices the other
# worker's threads need. Four HybridAdam parity tests took 180 s that way and 25 s with
# OMP_WAIT_POLICY=PASSIVE (docs/results/suite_s12.log: 78-92 s each under xdist, 8.9 s alone).
# The policy is read when the OpenMP runtime loads, so it is set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from tiermem import StoreConfig, TierStore


# Note [xdist groups]: README's test command runs the suite on two pytest-xdist workers with
# ``--dist loadgroup``, which hands out tests one by one. A module- or class-scoped fixture
# (a reference training run, a distributed job, a fork server) would then be set up once on
# each worker that gets one of its tests, doubling its cost; every test that uses one is put in
# the group of its module (``xdist_group``), so one worker runs all of them and the fixture
# once. Session-scoped fixtures are per worker either way (pytest's own, e.g.
# tmp_path_factory, are cheap) and do not group. This hook runs before xdist's, which reads
# the marks.
_GROUPED_SCOPES = ("module", "class", "package")


def _shares_a_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope in _GROUPED_SCOPES:
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _shares_a_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_tests_see_no_cuda(request, monkeypatch):
    """Note [CPU tests on a CUDA host]: ``torch.cuda.is_available()`` is False in CPU tests."""
    if "cuda" not in request.keywords and torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is faster and immune to a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_store(tmp_path):
    """Factory of stores with small budgets and a spill directory under tmp_path."""
    stores = []

    def make(**kw):
        kw.setdefault("gpu_bytes", 1 << 20)
        kw.setdefault("cpu_bytes", 1 << 20)
        kw.setdefault("nvme_bytes", 4 << 20)
        if kw["nvme_bytes"]:  # a spill directory only with a spill tier (else a warning)
            kw.setdefault("nvme_dir", str(tmp_path))
        kw.setdefault("pool_slab_bytes", 256 << 10)
        kw.setdefault("io_backend", "posix")
        kw.setdefault("io_threads", 2)
        kw.setdefault("io_chunk_bytes", 64 << 10)
        store = TierStore(StoreConfig(**kw))
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def held_puts(monkeypatch):
    """Every tensor any TierStore.put receives, held until the test ends: equal storage
    addresses then mean the same storage (none is freed and reused in between)."""
    from tiermem.store import TierStore
    held: list = []
    real = TierStore.put

    def put(self, key, tensor, tier=None):
        held.append(tensor)
        return real(self, key, tensor, tier)

    monkeypatch.setattr(TierStore, "put", put)
    return held
