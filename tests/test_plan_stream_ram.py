"""The plan's RAM (and NVMe) rows for streamed weights are what a real stream allocates (Note
[streamed RAM count] in tiermem/apps/plan/streaming.py): the planned model trained on the CPU,
every block streamed, the bytes counted from the stream's host copies and the store's stats.
Budgets are hard limits, so a plan that counts less RAM than the library takes is wrong."""

from __future__ import annotations

import functools

import pytest

from tiermem import StoreConfig, TierStore
from tiermem.apps.plan import plan
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from stream._stream_train import CFG, assert_same_run, make_model, train

PAGE = 4096


def _plan(tier: str, prefetch: int, **extra):
    """The plan of _stream_train's GPT (fp32, 2 micro-batches) with every block streamed from
    ``tier``: a GPU with room for the buffers alone."""
    L, micro = CFG.n_layers, 2
    kw = dict(n_layers=L, d_model=CFG.d_model, n_heads=CFG.n_heads, vocab=CFG.vocab,
              seq=CFG.seq_len, batch=2, dtype="float32", grad_accumulation_steps=micro,
              stream_weights=True, stream_tier=tier, prefetch_blocks=prefetch,
              gpu_reserve_bytes=0, host_bytes="64GiB", nvme_bytes="64GiB")
    kw.update(extra)
    w = sum(p.numel() for p in make_model().blocks[0].parameters()) * 4
    others = plan(CFG.num_params(), **kw, gpu_bytes=1 << 30).used["gpu"] - L * 2 * w
    p = plan(CFG.num_params(), **kw, gpu_bytes=others + (prefetch + 2) * 2 * w)
    assert p.stream.streamed == tuple(range(L))
    return p, {i.name: i for i in p.items}


def _paged_block() -> int:
    """One block's weights in the store, counted from the real tensors: whole pages each."""
    return sum(-(-p.numel() * p.element_size() // PAGE) * PAGE
               for p in make_model().blocks[0].parameters())


@pytest.mark.parametrize("prefetch", [0, 1])
def test_nvme_home_of_trained_weights_ram_is_the_host_copies_plus_the_staging(
        tmp_path, prefetch, one_thread):
    """tier="nvme" with trained weights: RAM holds a host copy of every streamed weight (what
    the optimizer steps) beside the NVMe copy, plus the store's staging. The plan's
    ``parameters`` host row is the host copies' bytes, its nvme row the spill space the
    placement took, and a store whose ``cpu_bytes`` is the plan's staging row trains 8 steps
    bit-identical to the loop without streaming, its RAM peaking at that row (before Note
    [streamed RAM count] the plan counted no host copy: 0 bytes of the ~0.2 MiB here)."""
    p, rows = _plan("nvme", prefetch)
    staging = rows["streaming RAM staging"].host
    L = CFG.n_layers
    assert staging == min(prefetch + 3, L) * _paged_block()
    fb = functools.partial(forward_backward, block_major=True)
    ref = train(make_model(), steps=8, n_micro=2, clip=1.0, fb=fb)
    store = TierStore(StoreConfig(device="cpu", gpu_bytes=1 << 20, cpu_bytes=staging,
                                  pool_slab_bytes=staging, nvme_bytes=16 << 20,
                                  nvme_dir=str(tmp_path), io_backend="posix", io_threads=2))
    held = {}

    def start(model):
        held["h"] = stream_weights(model.blocks, store=store, tier="nvme",
                                   prefetch_blocks=prefetch,
                                   gpu_bytes=p.stream.stream_gpu_bytes)
        store.synchronize()
        held["nvme"] = store.stats()["nvme"]["used_bytes"]  # the placement's NVMe copy
        return held["h"]

    model = make_model()
    try:
        got = train(model, steps=8, n_micro=2, clip=1.0, stream=start, fb=fb)
        assert_same_run(got, ref, "nvme home at the plan's staging")
        h = held["h"]
        host = [h.host_copy(q) for q in model.blocks.parameters()]
        assert len(host) == 12 * L
        assert sum(t.numel() * t.element_size() for t in host) == rows["parameters"].host
        assert held["nvme"] == rows["parameters"].nvme == L * _paged_block()
        # the store's RAM: the staging, filled to its budget by clean reads (Note [clean reads])
        assert store.stats()["cpu"]["peak_bytes"] == staging
        assert rows["parameters"].host + staging == p.used["host"] - sum(
            i.host for i in p.items if i.name not in ("parameters", "streaming RAM staging"))
        h.close()
    finally:
        store.close()


def test_ram_home_is_the_pool_blocks_of_the_streamed_weights(one_thread):
    """tier="cpu": the host copy is the store's pool block; the plan's ``parameters`` host row
    is what the pool holds after the placement, in whole pages (exact for tiermem's GPT)."""
    p, rows = _plan("cpu", 1)
    store = TierStore(StoreConfig(device="cpu", cpu_bytes="16MiB"))
    model = make_model()
    try:
        with stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1,
                            gpu_bytes=p.stream.stream_gpu_bytes):
            assert store.stats()["cpu"]["used_bytes"] == rows["parameters"].host \
                == CFG.n_layers * _paged_block()
            assert "streaming RAM staging" not in rows
    finally:
        store.close()


def test_the_nvme_home_of_trained_weights_is_not_chosen_to_save_ram():
    """A decision: RAM that cannot hold the streamed weights cannot hold them on an NVMe home
    either (the host copy stays), so ``stream_tier="auto"`` refuses instead of planning an NVMe
    home RAM cannot hold; with room, the NVMe home needs more RAM than the RAM home."""
    kw = dict(state_tier="cpu", host_reserve_bytes=0)  # RAM holds the optimizer state
    cpu, _ = _plan("cpu", 1, **kw)
    nvme, _ = _plan("nvme", 1, **kw)
    assert cpu.fits and nvme.fits
    assert nvme.used["host"] > cpu.used["host"]
    # RAM one byte short of the RAM home: neither home fits (an NVMe home needs more)
    short, _ = _plan("auto", 1, **kw, host_bytes=cpu.used["host"] - 1)
    assert not short.fits and any(r.startswith("host needs") for r in short.reasons)
    for home in ("cpu", "nvme"):
        assert not _plan(home, 1, **kw, host_bytes=cpu.used["host"] - 1)[0].fits, home
    fits, _ = _plan("auto", 1, **kw, host_bytes=cpu.used["host"])
    assert fits.fits and fits.stream.tier == "cpu"
