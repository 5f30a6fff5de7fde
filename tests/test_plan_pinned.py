"""Note [pinned rounding] (tiermem/apps/plan/pinned.py): torch pins each host gradient of a
streamed weight rounded up to a power of two, so the plan's ``"gradients"`` host row counts
them so: the planned model trained on the CPU with every block streamed, the host gradients
(and, depth-first, the staging tensors) it holds before a step rounded as torch's pinned
allocator rounds them, equal the row. Before the Note the row counted the bytes (the 13B
stream preset: 16.4 GiB planned, 22.8 GiB pinned on the H200)."""

from __future__ import annotations

import functools

import pytest

from tiermem.apps.plan import plan
from tiermem.apps.plan.pinned import pinned_bytes
from tiermem.schedule.micro_batches import forward_backward
from tiermem import StoreConfig, TierStore
from tiermem.stream import stream_weights
from tiermem.stream.grads import HostGrads

from stream._stream_train import CFG, make_model, train


def _power_of_two_at_least(n: int) -> int:
    """What CachingHostAllocator pins for ``n`` bytes, written out here (the reference)."""
    size = 1
    while size < n:
        size *= 2
    return size


@pytest.mark.parametrize("nbytes", [1, 2, 3, 4095, 4096, 4097, 150 << 20, (200 << 20) + 1])
def test_pinned_bytes_is_the_next_power_of_two(nbytes):
    assert pinned_bytes(nbytes) == _power_of_two_at_least(nbytes)


def test_pinned_bytes_of_nothing_and_of_a_negative_count():
    assert pinned_bytes(0) == 0
    with pytest.raises(ValueError, match="nbytes=-1 is negative"):
        pinned_bytes(-1)


@pytest.mark.parametrize("schedule", ["block-major", "depth-first"])
def test_the_gradients_row_is_what_the_run_pins(schedule, monkeypatch, one_thread):
    """8 AdamW steps of 2 micro-batches (the weights change every step), every block streamed
    from RAM; before each step the host gradients (depth-first: and each weight's staging
    tensor, made on the CPU as on CUDA) are what the run holds on the host for gradients."""
    monkeypatch.setattr(HostGrads, "stage_on_cpu", True)  # the staging CUDA makes
    L, micro = CFG.n_layers, 2
    kw = dict(n_layers=L, d_model=CFG.d_model, n_heads=CFG.n_heads, vocab=CFG.vocab,
              seq=CFG.seq_len, batch=2, dtype="float32", grad_accumulation_steps=micro,
              stream_weights=True, stream_tier="cpu", stream_schedule=schedule,
              prefetch_blocks=1, gpu_reserve_bytes=0, host_bytes="64GiB", nvme_bytes="64GiB")
    w = sum(p.numel() for p in make_model().blocks[0].parameters()) * 4
    others = plan(CFG.num_params(), **kw, gpu_bytes=1 << 30).used["gpu"] - L * 2 * w
    p = plan(CFG.num_params(), **kw, gpu_bytes=others + 3 * 2 * w)  # room for the buffers
    assert p.stream.streamed == tuple(range(L))
    row = next(i for i in p.items if i.name == "gradients")
    store = TierStore(StoreConfig(device="cpu", cpu_bytes="16MiB"))
    held, pinned = {}, []

    def start(model):
        held["h"] = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1,
                                   gpu_bytes=p.stream.stream_gpu_bytes)
        return held["h"]

    def count(model, step):  # the host tensors of gradients, as torch would pin them
        entries = [e for b in held["h"]._blocks for e in b.params]
        tensors = [e.param.grad for e in entries] + [e.staging for e in entries
                                                      if e.staging is not None]
        assert all(t is not None and t.device.type == "cpu" for t in tensors)
        pinned.append(sum(_power_of_two_at_least(t.numel() * t.element_size())
                          for t in tensors))

    fb = functools.partial(forward_backward, block_major=schedule == "block-major")
    try:
        losses, _, h = train(make_model(), steps=8, n_micro=micro, stream=start,
                             before_step=count, fb=fb)
        h.close(restore=False)
    finally:
        store.close()
    assert len({float(x.sum()) for x in losses}) == 8  # the weights changed every step
    exact = L * w * (2 if schedule == "depth-first" else 1)
    assert pinned == [row.host] * 8 and row.host > exact, (pinned, row.host, exact)
