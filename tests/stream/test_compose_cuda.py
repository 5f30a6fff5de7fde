"""Weight streaming composed with activation offload + checkpointing, and with LoRA, on CUDA
(issue 29 item 5; Note [backward release], Note [block-major offload]).

Each test trains a small GPT (4 blocks, d_model 256, 128 tokens, vocab 1024) for 8 AdamW steps
of 2 micro-batches, with the copy stream sleeping 20M cycles before each fill
(``torch.cuda._sleep``), and compares it with an independent reference of the same
configuration without the stream (same seed, same schedule, same offload/checkpointing, weights
resident; block weights the stream steps on the host have host masters stepped by the same
AdamW), within ``NOISE_MULTIPLE`` times the reference's run-to-run noise with torch's default
kernels (tests/_parity_harness.py). A block filled with the weights of the step before must go
red. The same logic is smoke-run on the CPU with the test GPT (zero noise: equality).
"""

from __future__ import annotations

import pytest
import torch
from _parity_harness import REFERENCE_RUNS, Run, assert_parity, first_step_noise, flat, summarise
from _stream_train import fills_per_pass
from torch import nn

from tiermem import StoreConfig, TierStore
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.offload import offload_activations
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

STEPS = 8
N_MICRO = 2
CUDA_CFG = GPTConfig(n_layers=4, d_model=256, n_heads=4, seq_len=128, vocab=1024)
CPU_CFG = GPTConfig(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab=64)


class LoRALinear(nn.Module):
    """A frozen ``base`` Linear plus a trainable rank-8 update."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


def make(cfg, dtype, lora, ckpt, device):
    torch.manual_seed(0)
    model = GPT(cfg, checkpoint=ckpt).to(dtype)
    if lora:
        model.requires_grad_(False)
        torch.manual_seed(1)
        for block in model.blocks:
            for name in ("qkv", "proj", "fc", "out"):
                setattr(block, name, LoRALinear(getattr(block, name)).to(dtype))
    return model.to(device)


def step_batches(cfg, step, device, batch=4):
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(N_MICRO):
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
        out.append((idx.to(device), torch.roll(idx, -1, dims=1).to(device)))
    return out


def run(case, device, tmp_path, stream, sleep_cycles=0, stale=False):
    """One training run; ``stream``: stream the blocks (else the reference, with host masters
    for the block weights the stream would step on the host)."""
    cfg, dtype, lora, ckpt, major, frozen_only = case
    model = make(cfg, dtype, lora, ckpt, device)
    hosted = set() if stream or frozen_only else {
        id(p) for p in model.blocks.parameters() if p.requires_grad}
    masters = {id(p): p.detach().to("cpu", copy=True) for p in model.parameters()
               if id(p) in hosted}
    order = [masters.get(id(p), p) for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(order, lr=3e-3, weight_decay=0.1)
    store = TierStore(StoreConfig(device=device, gpu_bytes=8 << 20, cpu_bytes=64 << 20,
                                  pool_slab_bytes=4 << 20))
    act = TierStore(StoreConfig(device=device, gpu_bytes=8 << 20, cpu_bytes=256 << 20,
                                pool_slab_bytes=4 << 20))
    off = offload_activations(model.blocks, store=act, layers=[0, 1, 2], min_offload_bytes=0)
    handle, snapshot = None, {}
    if stream:
        handle = stream_weights(model.blocks, store=store, prefetch_blocks=1,
                                frozen_only=frozen_only)
        handle._copies.sleep_cycles = sleep_cycles
        if stale:
            handle._fetcher.fault = lambda block, p, src: (snapshot.get(p.name, src)
                                                           if block.index == 1 else src)
    losses = []
    for step in range(STEPS):
        with off:
            losses.append(torch.stack(forward_backward(
                model, step_batches(cfg, step, device), block_major=major)))
        for p in model.parameters():
            if id(p) in hosted:
                masters[id(p)].grad = p.grad.to("cpu")
                p.grad = None
        if step == 0:
            grads0 = flat(q.grad for q in order)
        if stale:
            for name, q in model.blocks[1].named_parameters():  # this step's, stale after it
                snapshot[name] = q.detach().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in model.parameters():
                if id(p) in hosted:
                    p.copy_(masters[id(p)])
    result = Run(torch.cat(losses).double().cpu(), flat(order), grads0,
                 offloaded=off.counters["offloaded"])
    stats = handle.stats() if handle is not None else None
    if handle is not None:
        handle.close()
    off.close()
    store.close()
    act.close()
    return result, stats


def first_grads(case, device, tmp_path):
    cfg, dtype, lora, ckpt, major, _ = case
    model = make(cfg, dtype, lora, ckpt, device)
    act = TierStore(StoreConfig(device=device, gpu_bytes=8 << 20, cpu_bytes=256 << 20,
                                pool_slab_bytes=4 << 20))
    off = offload_activations(model.blocks, store=act, layers=[0, 1, 2], min_offload_bytes=0)

    def grads():
        with off:
            forward_backward(model, step_batches(cfg, 0, device), block_major=major)
        g = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()
                       if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return g

    return grads


def check(case, device, tmp_path, sleep_cycles, stale=False):
    refs = [run(case, device, tmp_path, stream=False)[0] for _ in range(REFERENCE_RUNS)]
    ref = summarise(refs, first_step_noise(first_grads(case, device, tmp_path)))
    got, stats = run(case, device, tmp_path, stream=True, sleep_cycles=sleep_cycles,
                     stale=stale)
    label = f"compose {case[1:]}"
    if stale:
        with pytest.raises(AssertionError, match="loss differs|final params differ|gradients"):
            assert_parity(got, ref, label + " (blocks[1] one step stale)")
        return
    assert_parity(got, ref, label)
    major = case[4]
    assert stats["fills"] == fills_per_pass(4, 1) * (1 if major else N_MICRO) * STEPS
    assert stats["peak_blocks"] <= 3  # prefetch 1 + 2 (Note [resident blocks])
    assert (got.offloaded == 0) == major  # Note [block-major offload]


CASES = {  # dtype, lora, checkpoint, block-major, frozen_only
    "offload-ckpt-depth-first": (torch.bfloat16, False, True, False, False),
    "offload-block-major": (torch.float32, False, False, True, False),
    "lora-frozen-base-ckpt": (torch.bfloat16, True, True, False, True),
    "lora-streamed-adapters-block-major": (torch.float32, True, False, True, False),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(CASES))
def test_streaming_composes_on_cuda_within_noise(tmp_path, name):
    check((CUDA_CFG, *CASES[name]), "cuda", tmp_path, sleep_cycles=20_000_000)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["offload-ckpt-depth-first",
                                  "lora-streamed-adapters-block-major"])
def test_a_one_step_stale_block_fails_the_tolerance_on_cuda(tmp_path, name):
    check((CUDA_CFG, *CASES[name]), "cuda", tmp_path, sleep_cycles=20_000_000, stale=True)


@pytest.mark.parametrize("name", ["offload-ckpt-depth-first", "lora-frozen-base-ckpt"])
def test_the_compose_cuda_logic_runs_on_the_cpu(tmp_path, one_thread, name):
    """The CUDA tests' logic (reference with host masters, noise-derived comparison, counts)
    on the CPU, where the reference's noise is 0: equality."""
    check((CPU_CFG, *CASES[name]), "cpu", tmp_path, sleep_cycles=0)


def test_the_compose_stale_check_runs_on_the_cpu(tmp_path, one_thread):
    check((CPU_CFG, *CASES["lora-streamed-adapters-block-major"]), "cpu", tmp_path,
          sleep_cycles=0, stale=True)
