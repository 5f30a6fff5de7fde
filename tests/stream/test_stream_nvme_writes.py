"""A weight streamed from NVMe is written once per optimizer step, however often the store's
cpu tier evicts it between reads (Note [clean reads] in tiermem/store/clean.py): the stream's
reads are clean, so an unchanged weight evicted again keeps its extent. Counts: bytes the spill
space writes per step, beside the bit-exact comparison with the loop without streaming."""

from __future__ import annotations

import torch

from tiermem import StoreConfig, TierStore
from tiermem.stream import stream_weights

from _stream_train import fills_per_pass, make_model, train


def test_nvme_weights_are_written_once_per_step(tmp_path, one_thread):
    steps, n_micro = 8, 2
    ref = train(make_model(), steps=steps, n_micro=n_micro, clip=1.0)
    block_bytes = sum(p.numel() * p.element_size() for p in make_model().blocks[0].parameters())
    store = TierStore(StoreConfig(device="cpu", gpu_bytes=1 << 20, nvme_bytes=16 << 20,
                                  cpu_bytes=3 * block_bytes + (1 << 16), nvme_dir=str(tmp_path),
                                  pool_slab_bytes=1 << 20, io_backend="posix", io_threads=2))
    written = []

    def stream(model):
        handle = stream_weights(model.blocks, store=store, tier="nvme", prefetch_blocks=1)
        store.synchronize()
        written.append(store._spill.bytes_written)  # the placement: every weight once
        return handle

    def before_step(model, step):
        store.synchronize()
        written.append(store._spill.bytes_written)

    try:
        losses, weights, handle = train(make_model(), steps=steps, n_micro=n_micro, clip=1.0,
                                        stream=stream, before_step=before_step)
        for step, (x, y) in enumerate(zip(losses, ref[0])):
            assert torch.equal(x, y), f"step {step}: {x.tolist()} != {y.tolist()}"
        once = written[0]
        assert once > 0
        # before step s's optimizer step: the placement plus s rewrites (pass starts 1..s)
        assert [w - once for w in written[1:]] == [s * once for s in range(steps)]
        assert handle.stats()["fills"] == fills_per_pass(4, 1) * n_micro * steps
        assert store.stats()["kept_bytes"] > 0  # evictions that wrote nothing
        handle.close()
    finally:
        store.close()
