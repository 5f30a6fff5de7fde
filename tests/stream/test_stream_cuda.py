"""Weight streaming on CUDA: the copy stream and its events are ordered right. The copy stream
sleeps before each fill (``torch.cuda._sleep``) to widen the window in which compute could read
weights that have not landed, or a freed buffer be reused under a copy; training must still be
bit-identical to an independent loop without streaming.

The reference keeps every weight on the GPU and an fp32/bf16 host master of each block weight
that the optimizer steps (the streamed run's layout: block weights and their gradients on the
host between passes, embeddings and head on the GPU), so both runs do the same arithmetic on the
same devices; attention uses SDPA's math kernel in both (deterministic backward).
"""

from __future__ import annotations

import pytest
import torch
from _stream_train import batches, make_model
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiermem import StoreConfig, TierStore
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights


def reference(device, dtype, ckpt, n_micro, clip, steps):
    """Resident weights on ``device``; block weights stepped on host masters."""
    model = make_model(dtype, ckpt).to(device)
    block_ids = {id(p) for p in model.blocks.parameters()}
    masters = {id(p): p.detach().to("cpu", copy=True) for p in model.blocks.parameters()}
    order = [masters.get(id(p), p) for p in model.parameters()]
    opt = torch.optim.AdamW(order, lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        mb = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
        losses.append(torch.stack(forward_backward(model, mb)).cpu())
        for p in model.parameters():
            if id(p) in block_ids:
                masters[id(p)].grad = p.grad.to("cpu")
                p.grad = None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(order, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in model.blocks.parameters():
                p.copy_(masters[id(p)])
    return losses


def streamed(device, dtype, ckpt, n_micro, clip, steps, store, tier, prefetch, sleep_cycles):
    model = make_model(dtype, ckpt).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    handle = stream_weights(model.blocks, store=store, tier=tier, prefetch_blocks=prefetch)
    handle._copies.sleep_cycles = sleep_cycles
    losses = []
    for step in range(steps):
        mb = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
        losses.append(torch.stack(forward_backward(model, mb)).cpu())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = handle.stats()
    handle.close()
    return losses, stats


def _run(device, tmp_path, tier, prefetch, dtype, n_micro, ckpt, clip, sleep_cycles):
    steps = 8
    with sdpa_kernel(SDPBackend.MATH):
        ref = reference(device, dtype, ckpt, n_micro, clip, steps)
        with TierStore(StoreConfig(device=device, gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                                   pool_slab_bytes=1 << 20, nvme_bytes=16 << 20,
                                   nvme_dir=str(tmp_path), io_backend="posix")) as store:
            out, stats = streamed(device, dtype, ckpt, n_micro, clip, steps, store, tier,
                                  prefetch, sleep_cycles)
    for step, (x, y) in enumerate(zip(out, ref)):
        assert torch.equal(x, y), f"step {step}: {x.tolist()} != {y.tolist()}"
    assert stats["fills"] == 2 * 4 * n_micro * steps
    assert stats["peak_blocks"] <= prefetch + 2


CASES = [("cpu", 1, torch.float32, 2, False, 1.0), ("cpu", 2, torch.bfloat16, 3, True, 0.5),
         ("nvme", 1, torch.bfloat16, 2, True, 1.0), ("cpu", 0, torch.float32, 1, True, None)]


@pytest.mark.cuda
@pytest.mark.parametrize("tier,prefetch,dtype,n_micro,ckpt,clip", CASES)
def test_streamed_training_on_cuda_is_bit_identical(tmp_path, tier, prefetch, dtype, n_micro,
                                                    ckpt, clip):
    _run("cuda", tmp_path, tier, prefetch, dtype, n_micro, ckpt, clip, sleep_cycles=20_000_000)


def test_the_cuda_reference_loop_runs_on_the_cpu(tmp_path, one_thread):
    """The CUDA test's logic (its reference with host masters, the comparison, the counts),
    smoke-run on the CPU."""
    _run("cpu", tmp_path, "nvme", 1, torch.float32, 2, True, 1.0, sleep_cycles=0)
