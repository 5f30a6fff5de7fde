"""CUDA twin of tests/offload/test_offload_corners.py for Note [handed-out reloads]: with
double buffering a reloaded tensor kept past its layer (a saved gradient AccumulateGrad takes
as ``.grad`` without a copy; a double-backward graph's saved tensors) must not be overwritten
by the next load into its set, which on CUDA runs on the buffers' own H2D stream (slowed here
with ``torch.cuda._sleep`` so a missing order shows). Eight SGD steps on new batches, the loss
compared at every step and the weights at the end, against torch without offload within the
reference's own run-to-run noise; the twin runs the old path (no check of the set, the
store's copy handed out as is) and must differ or raise."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiermem import StoreConfig, TierStore
from tiermem.offload import double_buffer, offload_activations

pytestmark = pytest.mark.cuda

D = 1024
ROWS = 512


class _SavedGrad(torch.autograd.Function):
    """``sum(w * x)``; the gradient for ``w`` is computed in forward, saved, and returned by
    backward as the saved tensor itself when the incoming gradient is 1 (as fused loss
    kernels do)."""

    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(x.sum(0))
        return (x * w).sum()

    @staticmethod
    def backward(ctx, g):
        grad_w, = ctx.saved_tensors
        return (grad_w if bool(g == 1) else grad_w * g), None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D) / D)
        self.extra = None

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * torch.sigmoid(x)
        self.extra = _SavedGrad.apply(self.w, torch.cos(h))
        return h


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randn(ROWS, D, device="cuda", generator=g, requires_grad=True)


def _train(mode: str, offload: bool, old_path: bool = False, monkeypatch=None):
    """8 SGD steps of 6 blocks; ``mode``: "saved grad" (one backward; ``w.grad`` is the
    unpacked saved tensor) or "penalty" (a gradient penalty through ``create_graph``)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(_Block() for _ in range(6))).cuda()
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-2)
    off = None
    if offload:
        store = TierStore(StoreConfig(device="cuda", gpu_bytes="4GiB", cpu_bytes="4GiB",
                                      nvme_bytes=0, pool_slab_bytes="64MiB"))
        off = offload_activations(list(blocks), store=store, layers=list(range(6)),
                                  double_buffering=True)
        off.__enter__()
        off.__exit__(None, None, None)  # builds the buffer sets, to slow their stream
        load = off._buffers.load

        def slow_load(records, st):  # the next layer's load queued late on its stream
            off._buffers.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(off._buffers.stream):
                torch.cuda._sleep(2_000_000)
            return load(records, st)

        off._buffers.load = slow_load
        if old_path:  # the code before Note [handed-out reloads]
            monkeypatch.setattr(double_buffer, "_referenced_elsewhere", lambda buf: False)
            monkeypatch.setattr(torch._C._autograd, "_get_current_graph_task_keep_graph",
                                lambda: False)
    losses = []
    for step in range(8):
        with off if off is not None else _null():
            x = _batch(step)
            out = blocks(x)
            loss = out.square().mean()
            if mode == "saved grad":
                loss = loss + sum(b.extra for b in blocks)
            else:
                g, = torch.autograd.grad(loss, x, create_graph=True)
                loss = loss + g.square().sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        losses.append(loss.detach())
    for b in blocks:
        b.extra = None  # unused by the penalty: its graph would keep its saved tensor
    params = [p.detach().clone() for p in blocks.parameters()]
    if off is not None:
        torch.cuda.synchronize()  # test only
        assert off.live_keys == 0 and off.stats()["offloaded"] > 0
        stats = off.stats()
        off.close()
        off.store.close()
        return torch.stack(losses), params, stats
    return torch.stack(losses), params, None


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _within_noise(ref, ref2, got, ulps: float = 1.0) -> str | None:
    """None if every tensor of ``got`` is within 4x the reference's run-to-run difference or
    ``ulps`` rounding steps at its largest magnitude; else what differs."""
    for i, (a, b, g) in enumerate(zip(ref, ref2, got)):
        noise, diff = (a - b).abs().max(), (g - a).abs().max()
        floor = ulps * torch.finfo(a.dtype).eps * a.abs().max()
        if not diff <= torch.maximum(4 * noise, floor):
            return f"tensor {i}: max diff {diff.item()} > 4 x {noise.item()} and > {floor.item()}"
    return None


@pytest.mark.parametrize("mode", ["saved grad", "penalty"])
def test_cuda_reloads_kept_past_their_layer_are_not_overwritten(mode):
    ref_losses, ref_params, _ = _train(mode, False)
    ref2_losses, ref2_params, _ = _train(mode, False)  # default kernels' noise
    losses, params, stats = _train(mode, True)
    assert _within_noise(list(ref_losses), list(ref2_losses), list(losses)) is None
    assert _within_noise(ref_params, ref2_params, params) is None
    if mode == "saved grad":
        assert stats["buffer_replaced"] > 0, stats


@pytest.mark.parametrize("mode", ["saved grad", "penalty"])
def test_cuda_old_path_twin_must_fail(monkeypatch, mode):
    """The same comparison on the old path fails: the tolerance above can tell."""
    ref_losses, ref_params, _ = _train(mode, False)
    ref2_losses, ref2_params, _ = _train(mode, False)
    try:
        losses, params, _ = _train(mode, True, old_path=True, monkeypatch=monkeypatch)
    except RuntimeError as exc:  # penalty: the overwrite caught as an in-place change
        assert "modified by an inplace operation" in str(exc)
        return
    assert (_within_noise(list(ref_losses), list(ref2_losses), list(losses)) is not None
            or _within_noise(ref_params, ref2_params, params) is not None)
