"""The block-major schedule with weight streaming on CUDA (Note [block-major passes]): the copy
stream sleeps before each fill (``torch.cuda._sleep``), widening the window in which a block's
M recomputations and backward passes could read weights that have not landed or a buffer be
reused under a copy; training must still be bit-identical to an independent depth-first loop
without streaming, with each streamed block filled twice per optimizer step.

The reference keeps every weight on the GPU and a host master of each block weight that the
optimizer steps (the streamed run's layout), so both runs do the same arithmetic on the same
devices; attention uses SDPA's math kernel in both (deterministic, and the same kernel with and
without autograd: the block-major forward runs under ``no_grad``).
"""

from __future__ import annotations

import pytest
import torch
from _stream_train import batches, make_model
from torch.nn.attention import SDPBackend, sdpa_kernel

from tiermem import StoreConfig, TierStore
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights


def _step(model, mb, passes, **kw):
    """One step's forward/backward, as ``passes`` calls over equal parts of ``mb``."""
    k = len(mb) // passes
    return [loss for j in range(passes) for loss in forward_backward(model, mb[j * k:(j + 1) * k],
                                                                     **kw)]


def reference(device, dtype, n_micro, passes, clip, steps):
    """Depth-first, resident weights on ``device``; block weights stepped on host masters."""
    model = make_model(dtype).to(device)
    block_ids = {id(p) for p in model.blocks.parameters()}
    masters = {id(p): p.detach().to("cpu", copy=True) for p in model.blocks.parameters()}
    order = [masters.get(id(p), p) for p in model.parameters()]
    opt = torch.optim.AdamW(order, lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        mb = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
        losses.append(torch.stack(_step(model, mb, passes)).cpu())
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


def block_major(device, dtype, n_micro, passes, clip, steps, store, tier, prefetch, saved,
                sleep_cycles):
    model = make_model(dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    handle = stream_weights(model.blocks, store=store, tier=tier, prefetch_blocks=prefetch)
    handle._copies.sleep_cycles = sleep_cycles
    losses, fills = [], []
    for step in range(steps):
        mb = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
        losses.append(torch.stack(_step(model, mb, passes, block_major=True,
                                         saved_store=store if saved else None,
                                         saved_tier=saved or "cpu")).cpu())
        fills.append(handle.stats()["fills"])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = handle.stats()
    handle.close()
    return losses, fills, stats


def _run(device, tmp_path, tier, prefetch, dtype, n_micro, passes, saved, clip, sleep_cycles):
    steps = 8
    with sdpa_kernel(SDPBackend.MATH):
        ref = reference(device, dtype, n_micro, passes, clip, steps)
        with TierStore(StoreConfig(device=device, gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                                   pool_slab_bytes=1 << 20, nvme_bytes=16 << 20,
                                   nvme_dir=str(tmp_path), io_backend="posix")) as store:
            out, fills, stats = block_major(device, dtype, n_micro, passes, clip, steps, store,
                                            tier, prefetch, saved, sleep_cycles)
            assert len(store) == 0  # the saved inputs and the weights are gone
    for step, (x, y) in enumerate(zip(out, ref)):
        assert torch.equal(x, y), f"step {step}: {x.tolist()} != {y.tolist()}"
    assert fills == [2 * 4 * passes * (s + 1) for s in range(steps)]  # 2 per block per pass
    assert stats["peak_blocks"] <= prefetch + 2


CASES = [  # tier, prefetch, dtype, micro-batches, passes per step, saved inputs, clip
    ("cpu", 1, torch.float32, 4, 1, None, 1.0),
    ("cpu", 2, torch.bfloat16, 2, 1, "cpu", None),
    ("nvme", 0, torch.bfloat16, 4, 2, "cpu", 0.5),  # host gradients added in the 2nd pass
    ("cpu", 1, torch.float32, 3, 1, "nvme", None),
]


@pytest.mark.cuda
@pytest.mark.parametrize("tier,prefetch,dtype,n_micro,passes,saved,clip", CASES)
def test_block_major_streaming_on_cuda_is_bit_identical(tmp_path, tier, prefetch, dtype,
                                                        n_micro, passes, saved, clip):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run `pytest -m cuda` on a GPU machine)")
    _run("cuda", tmp_path, tier, prefetch, dtype, n_micro, passes, saved, clip,
         sleep_cycles=20_000_000)


def test_the_block_major_cuda_logic_runs_on_the_cpu(tmp_path, one_thread):
    """The CUDA test's logic (its reference with host masters, two passes per step, the
    comparison, the fill counts), smoke-run on the CPU."""
    _run("cpu", tmp_path, "nvme", 1, torch.float32, 2, 2, "cpu", 1.0, sleep_cycles=0)
