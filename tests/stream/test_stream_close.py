"""Note [closing without a copy] (tiermem/stream/closing.py): ``WeightStream.close(restore=False)``
after training drops the streamed weights without copying them (no new storage at all), for
the cpu and nvme tiers with HybridAdam stepping the host copies and for weights homed on NVMe;
``close()`` still copies every streamed weight back (what the count sees); a bad ``restore``
is refused in one line."""

from __future__ import annotations

import pytest
import torch

from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.weights import stream_of

from _fresh_bytes import FreshBytes
from _stream_train import batches, make_model

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 8


def _trained(make_stream_store, tier: str, staging_blocks: int | None = None):
    """A small GPT trained 8 steps (2 micro-batches, different batches, the weights change
    every step) with its blocks streamed from ``tier``: HybridAdam (half its state offloaded)
    steps the streamed host copies; with ``staging_blocks`` the blocks are frozen, homed on
    NVMe, and AdamW trains the rest. Returns the model, the stream and its store, the
    optimizer closed."""
    model = make_model(torch.bfloat16)
    store = make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20, nvme_bytes=16 << 20)
    if staging_blocks is not None:
        model.blocks.requires_grad_(False)
    stream = stream_weights(model.blocks, store=store, tier=tier, prefetch_blocks=1,
                            staging_blocks=staging_blocks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(trainable, lr=3e-3) if staging_blocks is not None else
           HybridAdam(trainable, lr=3e-3, offload_fraction=0.5, chunk_numel=2048,
                      grad_accumulation_steps=2))
    losses = []
    for step in range(STEPS):
        losses.append(torch.stack(forward_backward(model, batches(step, 2))).sum().item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert len(set(losses)) == STEPS  # the weights changed every step
    if hasattr(opt, "close"):
        opt.close()
    return model, stream, store


@pytest.mark.parametrize("tier,staging", [("cpu", None), ("nvme", None), ("nvme", 2)])
def test_close_without_restore_copies_nothing(make_stream_store, tier, staging):
    model, stream, store = _trained(make_stream_store, tier, staging)
    params = [p for b in model.blocks for p in b.parameters()]
    shapes = [(p.dtype, p.device) for p in params]
    with FreshBytes() as fresh:
        stream.close(restore=False)
    assert fresh.bytes == 0, fresh.bytes  # today's close() copied every weight: ~40 KiB here
    assert stream.closed and len(store) == 0
    assert all(p.numel() == 0 and p.grad is None for p in params)
    assert [(p.dtype, p.device) for p in params] == shapes
    assert all(stream_of(p) is None for p in params)
    assert all(e.acc is None and e.staging is None for b in stream._blocks for e in b.params)
    with pytest.raises(RuntimeError):  # the dropped weights cannot be computed with
        model(*batches(0, 1)[0])
    stream.close(restore=False)  # idempotent


@pytest.mark.parametrize("tier,staging", [("cpu", None), ("nvme", 2)])
def test_close_with_restore_copies_every_streamed_weight_back(make_stream_store, tier, staging):
    """The control: the default close() makes each streamed weight an ordinary tensor again,
    equal to its host copy, so it allocates the streamed bytes (the count sees copies)."""
    model, stream, store = _trained(make_stream_store, tier, staging)
    params = [p for b in model.blocks for p in b.parameters()]
    streamed = sum(p.numel() * p.element_size() for p in params)
    if staging is None:
        want = [stream.host_copy(p).clone() for p in params]
    with FreshBytes() as fresh:
        stream.close()
    assert fresh.bytes >= streamed and len(store) == 0
    if staging is None:
        assert all(torch.equal(p.data, w) for p, w in zip(params, want))


def test_a_restore_that_is_not_a_bool_is_refused(make_stream_store):
    model = make_model()
    stream = stream_weights(model.blocks, store=make_stream_store())
    with pytest.raises(TypeError, match="restore='no' is not a bool"):
        stream.close(restore="no")
    assert not stream.closed
    stream.close()
