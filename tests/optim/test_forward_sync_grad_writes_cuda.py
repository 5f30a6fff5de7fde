"""CUDA twin of test_forward_sync_grad_writes.py (Note [gradient writes after a forward-synced
step] in tiermem/optim/grad_reads.py): ``model.zero_grad(set_to_none=False)`` right after a
``param_sync="forward"`` ``step()`` is queued on the caller's stream ahead of D2H copies the
worker has not issued yet (its CPU kernel slowed by 5 ms a call), or ahead of copies already
issued but held ~50 ms on the copy stream by ``torch.cuda._sleep``, and must be refused at
the next forward; ``set_to_none=True``, ``opt.zero_grad(set_to_none=False)`` and a write after
every read must step bit for bit as ``param_sync="step"`` (the same kernels: the CPU kernel,
torch's fused Adam on the GPU side and the lane) at every one of 8 steps."""

from __future__ import annotations

import pytest
import torch

from optim.test_forward_sync_grad_writes import (STEPS, _batch, _model, _wait_for_every_chunk,
                                                 _write, slow_worker)  # noqa: F401 (fixture)
from tiermem.optim import HybridAdam
from tiermem.store import transfer

SLEEP_CYCLES = 100_000_000  # ~50 ms of the copy stream before the copies (H200 clock)


def _cuda_model() -> torch.nn.Module:
    return _model().cuda()


def _hybrid(model, sync: str = "forward", **kw) -> HybridAdam:
    return HybridAdam(model.parameters(), lr=1e-3, offload_fraction=1.0, chunk_numel=1024,
                      param_sync=sync, **kw)


def _train(model, opt, after_step) -> list[float]:
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step).cuda()).square().mean()
        losses.append(loss.item())  # compared at every step
        loss.backward()
        opt.step()
        after_step(opt)
    opt.synchronize()
    torch.cuda.synchronize()
    return losses


def _as_param_sync_step(after_step, lane: float) -> None:
    model = _cuda_model()
    opt = _hybrid(model, gpu_step_fraction=lane)
    losses = _train(model, opt, lambda o: after_step(model, o))
    ref_model = _cuda_model()
    ref_opt = _hybrid(ref_model, "step", gpu_step_fraction=lane)
    ref_losses = _train(ref_model, ref_opt, lambda o: o.zero_grad())
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    opt.close(), ref_opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("lane", [0.0, 0.5])
@pytest.mark.parametrize("how", ["model_zero", "grad_mul", "grad_data"])
def test_cuda_in_place_write_before_the_copies_is_refused(slow_worker, lane, how):
    model = _cuda_model()
    opt = _hybrid(model, gpu_step_fraction=lane)
    model(_batch(0).cuda()).square().mean().backward()
    opt.step()
    _write(model, how)  # queued on the caller's stream before most copies are issued
    with pytest.raises(RuntimeError, match=r"written in place after step\(\) returned"):
        model(_batch(1).cuda())
    opt.zero_grad()
    model(_batch(2).cuda()).square().mean().backward()  # usable: the step was completed
    opt.step()
    opt.synchronize()
    opt.close()


@pytest.mark.cuda
def test_cuda_write_ahead_of_copies_already_issued_is_refused(monkeypatch):
    """Copies issued before ``step()`` returned but held on the copy stream: ``step()`` sums
    behind them; the zero on the caller's stream runs first."""
    d2h_many = transfer.Copier.d2h_many

    def late_d2h_many(self, pairs, after=None):
        if self.cuda and pairs:
            with torch.cuda.stream(self.d2h_stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # the copies start ~50 ms late
        return d2h_many(self, pairs, after)

    monkeypatch.setattr(transfer.Copier, "d2h_many", late_d2h_many)
    model = _cuda_model()
    opt = _hybrid(model)
    model(_batch(0).cuda()).square().mean().backward()
    opt.step()
    _write(model, "model_zero")
    with pytest.raises(RuntimeError, match="written in place after step"):
        opt.synchronize()
    opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("lane", [0.0, 0.5])
@pytest.mark.parametrize("reset", ["model_none", "opt_zero", "late_write"])
def test_cuda_resets_that_keep_the_read_bytes_step_as_param_sync_step(slow_worker, lane,
                                                                       reset):
    """Must pass beside the refusals above: nothing written before a read."""
    def after_step(model, opt):
        if reset == "model_none":
            model.zero_grad()
        elif reset == "opt_zero":
            opt.zero_grad(set_to_none=False)
        else:  # every read done (the copies synchronized by the worker), then zeroed
            _wait_for_every_chunk(opt)
            torch.cuda.synchronize()
            model.zero_grad(set_to_none=False)

    _as_param_sync_step(after_step, lane)
