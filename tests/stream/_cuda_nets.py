"""The model and the slowed D2H copy the CUDA gradient-wait tests share
(tests/stream/test_hand_off_cuda.py, tests/stream/test_grad_adds_cuda.py): ``BLOCKS`` blocks of
one ``WIDTH`` x ``WIDTH`` linear layer each, the D2H stream made to sleep ~50 ms before every
gradient copy, the store they stream from and the relative update error they compare by."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tiermem import StoreConfig, TierStore

WIDTH = 512
BLOCKS = 4
STEPS = 8
SLEEP_CYCLES = 100_000_000  # ~50 ms at the H200's ~2 GHz: far longer than a take or hand-off
REL_TOL = 1e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def twin_nets(device: str = "cuda"):
    """``(ref, model, start)``: a seeded ``Net`` on ``device``, a copy of it, its start weights."""
    torch.manual_seed(0)
    ref = Net().to(device)
    model = copy.deepcopy(ref)
    start = [p.detach().clone() for p in ref.parameters()]
    return ref, model, start


def slow_grad_out(real):
    """``StreamCopies.grad_out`` (``real``) whose copy, on CUDA, lands ~50 ms late."""
    def grad_out(self, dst, src):
        if self.cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            self.d2h_stream.wait_event(produced)  # the sleep starts once the gradient exists
            with torch.cuda.stream(self.d2h_stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # the copy issued next lands ~50 ms late
        return real(self, dst, src)
    return grad_out


def stream_store(device: str = "cuda") -> TierStore:
    """The store the streamed model's weights live in: 32 MiB GPU, 64 MiB RAM, no NVMe."""
    return TierStore(StoreConfig(device=device, gpu_bytes=32 << 20, cpu_bytes=64 << 20,
                                 pool_slab_bytes=4 << 20))


def update_errors(model, ref, start) -> list[float]:
    """Per parameter: ``|model - ref| / |ref - start|`` (the relative update error), printed."""
    errors = []
    for k, (a, b, b0) in enumerate(zip(model.parameters(), ref.parameters(), start)):
        rel = float(torch.linalg.vector_norm(a.detach().to(b.device) - b)
                    / torch.linalg.vector_norm(b - b0))
        print(f"block {k}: relative update error {rel:.2e}")
        errors.append(rel)
    return errors
