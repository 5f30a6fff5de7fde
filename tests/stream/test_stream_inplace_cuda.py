"""Streamed weights changed in place through ``param.data`` during a pass, on CUDA (Note [streamed
weight checksums] in tiermem/stream/checksums.py): the fill's checksums run on the copy stream,
the release's on the compute stream, and the comparison lands in pinned memory behind an event,
so the refusal comes at a later release, the pass end or at the latest the optimizer's pre-step
hook, before the step. The copy stream sleeps before each fill to widen the windows in which a
wrongly ordered checksum would read a buffer not yet filled (a false alarm). Each test also
smoke-runs on the CPU (the same logic; the comparison is made at once there)."""

from __future__ import annotations

import pytest
import torch
from _stream_train import batches, make_model

from tiermem import StoreConfig, TierStore
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"]
STEPS = 8
SLEEP = 20_000_000


def _setup(device, dtype=torch.float32, prefetch=1, ckpt=False):
    model = make_model(dtype, ckpt).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    store = TierStore(StoreConfig(device=device, gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                                  pool_slab_bytes=1 << 20, nvme_bytes=0))
    h = stream_weights(model.blocks, store=store, prefetch_blocks=prefetch)
    if device == "cuda":
        h._copies.sleep_cycles = SLEEP
    return model, opt, store, h


def _to(device, mb):
    return [(i.to(device), t.to(device)) for i, t in mb]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_raises_no_false_alarm(device, dtype, one_thread):
    """8 steps, 2 micro-batches, checkpointing: nothing changes the weights on the device, so
    no error; every block made ready is checksummed at its release (as many as fills)."""
    model, opt, store, h = _setup(device, dtype, ckpt=True)
    with store, h:
        for step in range(STEPS):
            losses = forward_backward(model, _to(device, batches(step, 2)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert all(torch.isfinite(x).all() for x in losses)
        stats = h.stats()
        assert stats["checked_blocks"] == stats["fills"] > 0


def _kept_block(model, mb):
    idx, tgt = mb[0]
    _, loss = model(idx, tgt)
    model.blocks[3].fc.weight.data.mul_(0.5)  # kept on the device for the backward
    loss.backward()


def _in_forward(model, mb):
    def scale(m, args):
        m.weight.data.mul_(0.5)  # blocks[0] is on the device while it computes

    handle = model.blocks[0].fc.register_forward_pre_hook(scale)
    try:
        forward_backward(model, mb)
    finally:
        handle.remove()


def _host_reference(model, mb):
    host = model.blocks[0].fc.weight.data  # between passes: the host copy itself
    idx, tgt = mb[0]
    _, loss = model(idx, tgt)
    if idx.is_cuda:  # the forward's fill has read the host copy (a write racing that
        torch.cuda.synchronize()  # in-flight copy may reach either fill)
    host.mul_(0.5)  # blocks[0] was released in the forward; its backward refills it
    loss.backward()


ON_DEVICE = "was changed in place on the device during a pass"
REFILLED = "was filled with other values than earlier in the same pass"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit,block,what", [(_kept_block, 3, ON_DEVICE),
                                             (_in_forward, 0, ON_DEVICE),
                                             (_host_reference, 0, REFILLED)],
                         ids=["before-backward", "in-forward", "host-copy"])
def test_a_data_write_during_a_pass_is_refused_before_the_step(device, edit, block, what,
                                                                one_thread):
    """At step 3 a ``.data.mul_`` changes a block's device buffer (or its host copy) during
    the pass: refused by the step at the latest, which then changes nothing (the host copies
    keep the values they had before the pass, but for a host copy written: it keeps the
    write); training goes on without an error."""
    model, opt, store, h = _setup(device, prefetch=0 if edit is _in_forward else 1)
    with store, h:
        for step in range(STEPS):
            mb = _to(device, batches(step, 1))
            if step != 3:
                forward_backward(model, mb)
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            before = {k: v.detach().clone() for k, v in model.blocks.state_dict().items()}
            if what == REFILLED:
                before["0.fc.weight"] *= 0.5
            with pytest.raises(RuntimeError, match=rf"blocks\[{block}\]\.fc\.weight {what}"):
                edit(model, mb)
                opt.step()
            assert not h.in_pass and not h.closed
            opt.zero_grad(set_to_none=True)
            after = model.blocks.state_dict()
            for k, v in before.items():
                assert torch.equal(after[k], v), f"{k} changed by the refused step"
