"""On CUDA: a weight stream pins what the plan counts (Note [exact pinning] in
tiermem/store/pinned.py, Note [host gradient slabs] in tiermem/stream/grad_slabs.py). A GPT of
4 blocks (d_model 512, bf16: ~6 MiB of weights a block, 1.5 MiB qkv weights that torch's pinned
allocator rounds to 2 MiB) streamed from the store's RAM, trained 8 steps by AdamW: tiermem's
registered bytes are the store's pool slabs plus one slab per streamed block of
``block_grad_bytes`` (the plan's gradients row per block), constant over the steps (each step
reuses the step before's pages), torch's own pinned allocator grows by less than 1 MiB (before
the fix it held every host gradient, ~25 MiB rounded up), every host gradient is pinned, and
closing the stream and the store unpins everything."""

from __future__ import annotations

import gc

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.schedule.micro_batches import forward_backward
from tiermem.store.pinned import default_pinner
from tiermem.stream import stream_weights
from tiermem.stream.grad_slabs import block_grad_bytes

CFG = GPTConfig(n_layers=4, d_model=512, n_heads=8, seq_len=64, vocab=256)
MiB = 1 << 20


def _batches(step: int) -> list:
    gen = torch.Generator().manual_seed(2000 + step)
    idx = torch.randint(0, CFG.vocab, (2, CFG.seq_len), generator=gen)
    return [(idx.cuda(), torch.roll(idx, -1, dims=1).cuda())]


def _torch_pinned() -> int:
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


@pytest.mark.cuda
def test_a_stream_on_cuda_pins_what_the_plan_counts():
    gc.collect()  # stores of earlier tests unpin now, not while this one counts
    torch.cuda.init()
    pinner = default_pinner()
    mine0, torch0 = pinner.live_bytes, _torch_pinned()
    torch.manual_seed(0)
    model = GPT(CFG, checkpoint=True).to(torch.bfloat16).cuda()
    block_bytes = sum(p.numel() * 2 for p in model.blocks[0].parameters())
    assert all(p.numel() * 2 % 64 == 0 for p in model.blocks[0].parameters())  # plan exact
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    store = TierStore(StoreConfig(device="cuda", gpu_bytes=0, cpu_bytes=64 * MiB,
                                  pool_slab_bytes=16 * MiB, pin_memory=True))
    handle = stream_weights(model.blocks, store=store, tier="cpu", prefetch_blocks=1)
    plan_grads = len(model.blocks) * block_grad_bytes([block_bytes])  # place_stream's row
    losses, pinned = [], []
    for step in range(8):
        losses.append(torch.stack(forward_backward(model, _batches(step))).float().cpu())
        for block in model.blocks:
            assert all(p.grad.device.type == "cpu" and p.grad.is_pinned()
                       for p in block.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        pool = store.stats()["pinned_bytes"]
        pinned.append(pinner.live_bytes - mine0)
        assert pinned[-1] == pool + plan_grads, (pinned[-1], pool, plan_grads)
    assert len(set(pinned)) == 1  # each step reuses the pages of the step before
    assert handle._grads.slabs.fallbacks == 0  # no gradient went to torch's allocator
    assert _torch_pinned() - torch0 < MiB  # the host gradients are not torch's rounded blocks
    flat = torch.cat(losses)
    assert torch.isfinite(flat).all() and len(set(flat.tolist())) == 8
    handle.close()
    store.close()
    assert pinner.live_bytes == mine0
