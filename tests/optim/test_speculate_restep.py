"""Note [speculative step]: a chunk rolled back and queued again reads its gradients only once
``step()`` has clipped them. The old code still counted it as admitted, so a worker that took
it between the re-queue and ``step()``'s allowance read the gradients after their own events
only: on CUDA before the clip (and a GradScaler's unscale) queued on the caller's stream had
run. It showed on the H200 under 4 test processes sharing the GPU (the clipping cases of
test_grad_scaler_overlap_cuda.py: 1.36 from AdamW's weights against a bound of 0.02).

Here the window is held open: after ``settle`` has re-queued the rolled-back chunks, ``step()``
waits until the worker asks for one's gradients (bounded), then 20 ms more. On the CPU the
decision is checked (every re-stepped chunk's gradients are handed out only after the
allowance: the old code handed them out before it); on CUDA the clip is also delayed on the
caller's stream (``torch.cuda._sleep``), and a speculating optimizer must stay bit-identical
at every step to a waiting one fed clones of its gradients (the old code stepped the
unclipped gradients there: red).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models
from optim.test_speculate import STEPS, _bits, assert_same_bits
from optim.test_worker_windows import drain
from tiermem.optim import HybridAdam, speculate
from tiermem.optim.step_state import StepState

SLEEP_CYCLES = 100_000_000  # ~50 ms of the caller's stream before the clip (H200 clock)


class _Window:
    """Holds open the window between the re-queue of rolled-back chunks and ``step()``'s
    allowance, and records, for each re-stepped chunk's gradients handed out, whether the
    allowance had been given."""

    def __init__(self, monkeypatch, delay_clip: bool = False) -> None:
        self.allowed: list[bool] = []  # per re-stepped chunk whose gradients were handed out
        self.requeued = 0
        asked = threading.Event()
        chunk_grads, settle, clip = StepState.chunk_grads, speculate.Speculation.settle, \
            speculate.clip_
        window = self

        def recording(self, g, chunk, block=True):
            restep = self.is_restep((g, chunk.index))
            if restep:
                asked.set()
            out = chunk_grads(self, g, chunk, block)
            if restep and out is not None:
                window.allowed.append(self.compute_allowed.is_set())
            return out

        def settle_then_wait(self, *args, **kw):
            asked.clear()
            out = settle(self, *args, **kw)
            if out:  # chunks re-queued, step() not yet allowed
                window.requeued += out
                asked.wait(2.0)
                time.sleep(0.02)
            return out

        def late_clip(grads, coef):
            torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream clips ~50 ms from now
            return clip(grads, coef)

        monkeypatch.setattr(StepState, "chunk_grads", recording)
        monkeypatch.setattr(speculate.Speculation, "settle", settle_then_wait)
        if delay_clip:
            monkeypatch.setattr(speculate, "clip_", late_clip)


def _opt(model, lane: float, budget: int) -> HybridAdam:
    return HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                      gpu_step_fraction=lane, max_grad_norm=1e-3, rollback_bytes=budget,
                      placement="given")


def _train_pair(device: str, lane: float) -> tuple:
    """A speculating optimizer (A: its hooks ship gradients as they land) and a waiting one
    (B: ``rollback_bytes=0``, handed clones of A's gradients); every step clips. Parameters
    compared bit for bit before every step; returns the models, optimizers and rollbacks."""
    a, b = make_models(device=device), make_models(device=device)
    opt_a, opt_b = _opt(a, lane, 1 << 30), _opt(b, lane, 0)
    rolled = []
    for step in range(STEPS):
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(_bits(pa), _bits(pb)), (step, name)
        a(*make_batch(step, device=device))[1].backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.detach().clone()  # before A's step() clips A's in place
        drain(opt_a)  # idle when step() re-queues: else on CUDA the window stays shut
        opt_a.step()
        opt_b.step()
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=True)
        rolled.append(opt_a.step_stats()["rolled_back_chunks"])
    opt_a.synchronize(), opt_b.synchronize()
    return a, opt_a, b, opt_b, rolled


@pytest.mark.parametrize("lane", [0.0, 1.0])
def test_a_restepped_chunk_reads_its_gradients_after_the_clip(monkeypatch, one_thread, lane):
    window = _Window(monkeypatch)
    a, opt_a, b, opt_b, rolled = _train_pair("cpu", lane)
    assert sum(rolled) > 0 and window.requeued == sum(rolled), (rolled, window.requeued)
    assert len(window.allowed) == sum(rolled) and all(window.allowed), window.allowed
    assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
    opt_a.close(), opt_b.close()


@pytest.mark.cuda
@pytest.mark.parametrize("lane", [0.0, 1.0])
def test_cuda_a_restepped_chunk_steps_the_clipped_gradients(monkeypatch, lane):
    window = _Window(monkeypatch, delay_clip=True)
    a, opt_a, b, opt_b, rolled = _train_pair("cuda", lane)
    torch.cuda.synchronize()
    assert sum(rolled) > 0 and len(window.allowed) == sum(rolled), (rolled, window.allowed)
    assert all(window.allowed), window.allowed
    assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
    opt_a.close(), opt_b.close()
