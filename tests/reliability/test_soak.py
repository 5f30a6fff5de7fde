"""Soak: many training steps with HybridAdam on NVMe and activations offloaded to NVMe, and no
growth in pool/pinned bytes, spill usage, files, descriptors or threads after warm-up."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierStore
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

STEPS = int(os.environ.get("TIERMEM_SOAK_STEPS", 200))
WARMUP = 10
"""Steps before measuring; steps WARMUP..3*WARMUP set the high-water marks of every
measure (HybridAdam's NVMe state streams in and out of the cpu tier within a step), and every
later step must stay at or below them."""


def _files(root) -> int:
    return sum(len(files) + len(dirs) for _, dirs, files in os.walk(root))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


def _spilled(*stats) -> int:
    return sum(v for s in stats for k, v in s["moved_bytes"].items() if k.endswith("->nvme"))


def _train(tmp_path, steps, offload, on_step=None):
    torch.manual_seed(0)
    model = TinyGPT()
    (tmp_path / "opt").mkdir(exist_ok=True)
    (tmp_path / "act").mkdir(exist_ok=True)
    opt = HybridAdam(model.parameters(), lr=3e-3, offload_fraction=0.5, state_tier="nvme",
                     nvme_dir=str(tmp_path / "opt"), chunk_numel=8192)
    store = TierStore(StoreConfig(gpu_bytes=1 << 20, cpu_bytes=1 << 20, nvme_bytes=4 << 20,
                                  nvme_dir=str(tmp_path / "act"), io_backend="posix",
                                  io_threads=2, pool_slab_bytes=256 << 10,
                                  io_chunk_bytes=64 << 10))
    losses = []
    try:
        for step in range(steps):
            if offload:
                with offload_activations(model.blocks, store=store, tier="nvme") as off:
                    _, loss = model(*make_batch(step))
                    loss.backward()
            else:
                off = None
                _, loss = model(*make_batch(step))
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, opt, store, off)
    finally:
        opt.close()
        store.close()
    return losses


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2-core CI: OpenMP spinning against the I/O threads is slow
    yield
    torch.set_num_threads(n)


def test_offloaded_training_is_bit_identical_to_plain(tmp_path, one_thread):
    # a race between the offload copies and backward would show up here (torchtune's NaNs)
    assert _train(tmp_path, 15, offload=True) == _train(tmp_path, 15, offload=False)


@pytest.mark.slow
def test_soak_no_growth_in_memory_files_descriptors_or_threads(tmp_path, one_thread):
    base: dict = {}
    seen: list = []
    state_bytes: list = []
    figures = dict(steps=STEPS, activations_offloaded=0, optimizer_chunks_stepped=0)

    def on_step(step, opt, store, off):
        s = store.stats()
        pool_threads = store.config.io_threads + opt.store.config.io_threads
        off_stats = off.stats()
        assert off_stats["store_full"] == off_stats["gpu_full"] == off_stats["live_keys"] == 0
        assert off_stats["offloaded"] > 0
        # every activation key is gone once backward is done: the store is empty again
        assert [s[t]["used_bytes"] for t in ("gpu", "cpu", "nvme")] == [0, 0, 0]
        # HybridAdam's state chunks stream between its store's nvme and cpu tiers; once its
        # write-backs landed, each chunk is in exactly one of them (both round to 4 KiB)
        opt.store.synchronize()
        o = opt.store.stats()
        now = dict(
            act_pinned=s["pinned_bytes"], opt_pinned=o["pinned_bytes"],
            opt_state=o["cpu"]["used_bytes"] + o["nvme"]["used_bytes"],
            files=_files(tmp_path), fds=_fds(), threads=_threads(),
            py_threads=threading.active_count())
        # the pools keep slabs for reuse (pinning is slow): bounded by the budget and by the
        # peak of live bytes (one slab of slack for fragmentation), never by the step count
        for st, stats in ((store, s), (opt.store, o)):
            slab = st._pool.slab_bytes
            bound = (-(-stats["cpu"]["peak_bytes"] // slab) + 1) * slab
            assert st._pool.reserved_bytes <= min(st.config.cpu_bytes, bound), (step, bound)
        figures["activations_offloaded"] += off_stats["offloaded"]
        figures["optimizer_chunks_stepped"] += opt.step_stats()["chunks"]
        if step in (WARMUP, STEPS - 1):  # the figures of docs/reliability.md
            when = "before" if step == WARMUP else "after"
            figures[when] = dict(rss_mib=_rss_mib(), fds=now["fds"], threads=now["threads"])
            figures["bytes_spilled"] = _spilled(s, o)
        if step == WARMUP:
            state_bytes.append(now["opt_state"])
        assert step < WARMUP or now["opt_state"] == state_bytes[0], step
        if WARMUP <= step < 3 * WARMUP:  # the warm-up window sets the high-water marks
            for k, v in now.items():
                base[k] = max(base.get(k, v), v)
        elif step >= 3 * WARMUP:
            # I/O thread pools start their workers lazily, when requests first overlap
            slack = dict(threads=pool_threads, py_threads=pool_threads)
            grown = {k: (base[k], v) for k, v in now.items() if v > base[k] + slack.get(k, 0)}
            assert not grown, f"step {step}: above the warm-up high-water mark: {grown}"
        seen.append(step)

    losses = _train(tmp_path, STEPS, offload=True, on_step=on_step)
    print(f"\nsoak figures: {json.dumps(figures)}")  # shown with -s; kept in docs/reliability.md
    assert len(seen) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it trained
    # opt/ and act/, each with one private dir holding its marker and its spill file
    assert base["files"] == 8
    # both stores are closed: their private directories are gone
    assert sorted(os.listdir(tmp_path)) == ["act", "opt"]
    assert os.listdir(tmp_path / "act") == [] and os.listdir(tmp_path / "opt") == []


def test_closing_a_store_stops_its_io_threads(tmp_path):
    before = threading.active_count()
    stores = []
    for _ in range(3):
        store = TierStore(StoreConfig(cpu_bytes=1 << 20, nvme_bytes=1 << 20,
                                      nvme_dir=str(tmp_path), io_backend="posix", io_threads=2))
        store.put("k", torch.ones(5000), tier="nvme")
        store.put("j", torch.ones(5000), tier="nvme")
        store.get("k", "cpu")
        store.close()
        stores.append(store)  # e.g. an optimizer or offloader still holding its closed store
    assert threading.active_count() == before
