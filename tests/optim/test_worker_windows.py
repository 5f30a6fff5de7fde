"""HybridAdam's worker <-> caller protocol: windows where the worker reads gradients that
``step()`` writes on the caller's side (tests/optim/test_speculate_restep.py holds the first
one found: a rolled-back chunk stepped before the clip).

Note [unscaled before the hand-over] (amp_scaling.py): under a GradScaler, a step whose backward
handed nothing to the CPU step (fewer backward passes than ``grad_accumulation_steps``: an
epoch's short last window) has its gradients unscaled in place by ``take_scaler``; ``step()``
then ships them all. Admission to the speculative step was still open there, so those chunks
were admitted and unscaled their gradient copies a second time (the scale matched, nothing
rolled back). Here the window is held open (``settle_step`` waits until the worker asks for a
chunk's gradients, then 20 ms more) and the decision is checked: no chunk is admitted after
the in-place unscale (the old code admitted them: red); a speculating optimizer must stay
bit-identical at every step to a waiting one (``rollback_bytes=0``) fed clones of its
gradients (the old code: 0.011 apart after 6 steps). The CUDA twin is
test_worker_windows_cuda.py.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models
from optim.test_speculate import _bits, assert_same_bits
from tiermem.optim import HybridAdam, hybrid_adam, speculate
from tiermem.optim.step_state import StepState

STEPS = 8
PASSES = 2  # grad_accumulation_steps
SHORT = {2, 4, 7}  # steps with one backward pass: nothing is handed over in backward


class UnscaleWindow:
    """Holds open the window between ``take_scaler``'s in-place unscale and ``settle_step``
    (where ``step()`` ships every gradient), and records the chunks admitted in it."""

    def __init__(self, monkeypatch) -> None:
        self.in_place: list[bool] = []  # per step: take_scaler unscaled in place, speculating
        self.late: list[tuple[int, int]] = []  # chunks admitted after that unscale
        self.open = False
        asked = threading.Event()
        take, settle_step = hybrid_adam.take_scaler, hybrid_adam.settle_step
        admit, chunk_grads = speculate.Speculation.admit, StepState.chunk_grads
        window = self

        def taking(opt, *args, **kw):
            out = take(opt, *args, **kw)
            if not opt._spec.budget_bytes:  # the waiting optimizer: never speculates
                return out
            amp = opt._spec.amp
            window.open = (not out and amp.pending is None and amp.expected is not None
                           and opt._spec.active)
            window.in_place.append(window.open)
            asked.clear()
            return out

        def settling(opt):
            if window.open:  # the worker has the chunks step() shipped
                asked.wait(2.0)
                time.sleep(0.02)
            window.open = False
            return settle_step(opt)

        def admitting(self, item):
            out = admit(self, item)
            if out and window.open:
                window.late.append(item)
            return out

        def asking(self, g, chunk, block=True):
            if window.open:
                asked.set()
            return chunk_grads(self, g, chunk, block)

        monkeypatch.setattr(hybrid_adam, "take_scaler", taking)
        monkeypatch.setattr(hybrid_adam, "settle_step", settling)
        monkeypatch.setattr(speculate.Speculation, "admit", admitting)
        monkeypatch.setattr(StepState, "chunk_grads", asking)


def _opt(model, lane: float, budget: int) -> HybridAdam:
    return HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                      gpu_step_fraction=lane, rollback_bytes=budget, placement="given",
                      grad_accumulation_steps=PASSES)


def drain(opt, limit_s: float = 60.0) -> None:
    """Wait (bounded) until the worker has stepped every chunk it was given (all of them
    speculate on a full window: the speculation counts are the decisions, not timing)."""
    step = opt._step
    end = time.monotonic() + limit_s
    with step.idle:
        while step.outstanding and time.monotonic() < end:
            step.idle.wait(1.0)


def train_short_windows(device: str, lane: float) -> tuple:
    """A speculating optimizer (A) and a waiting one (B: ``rollback_bytes=0``, handed clones of
    A's scaled gradients), each under its own GradScaler; the steps of ``SHORT`` take one
    backward pass of ``PASSES``. Parameters compared bit for bit before every step; returns
    the models, optimizers and A's speculated chunks per step."""
    a, b = make_models(device=device), make_models(device=device)
    opt_a, opt_b = _opt(a, lane, 1 << 30), _opt(b, lane, 0)
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=1000)
               for _ in range(2)]
    speculated = []
    for step in range(STEPS):
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(_bits(pa), _bits(pb)), (step, name)
        passes = 1 if step in SHORT else PASSES
        for k in range(passes):
            loss = a(*make_batch(step * PASSES + k, device=device))[1]
            scalers[0].scale(loss / passes).backward()
        scalers[1].scale(loss.detach())  # B's scaler starts its scale as A's did
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.detach().clone()  # scaled, before A's step() unscales them
        if opt_a._spec.active:  # else the chunks wait for step(): nothing to drain
            drain(opt_a)
        for scaler, opt in zip(scalers, (opt_a, opt_b)):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        speculated.append(opt_a.step_stats()["speculated_chunks"])
    opt_a.synchronize(), opt_b.synchronize()
    return a, opt_a, b, opt_b, speculated


@pytest.mark.parametrize("lane", [0.0, 1.0])
def test_chunks_shipped_after_the_in_place_unscale_are_not_unscaled_again(monkeypatch,
                                                                          one_thread, lane):
    window = UnscaleWindow(monkeypatch)
    a, opt_a, b, opt_b, speculated = train_short_windows("cpu", lane)
    # premise: the short windows unscaled in place on speculating steps, the full ones speculated
    assert [s for s, w in enumerate(window.in_place) if w] == sorted(SHORT), window.in_place
    assert all(speculated[s] > 0 for s in range(1, STEPS) if s not in SHORT), speculated
    assert window.late == [], window.late  # the old code admitted them
    assert all(speculated[s] == 0 for s in SHORT), speculated
    assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
    opt_a.close(), opt_b.close()


# Note [reduced gradients untouched] (dist_modes.py): ZeRO with overlap=True reduces p.grad into
# its bucket in the hook; a change to p.grad after backward used to be ignored silently.


@contextlib.contextmanager
def world_of_one(tmp_path, backend: str = "gloo"):
    """A torch.distributed group of this process alone (ZeRO's collectives run, on one rank)."""
    dist = torch.distributed
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _zero(model, overlap: bool) -> HybridAdam:
    return HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024,
                      data_parallel=True, overlap=overlap)


def _change(kind: str, model, loss, scaler, delay=None) -> None:
    """Backward, then change the gradients behind it as ``kind`` says (after ``delay()``:
    the CUDA twin holds the caller's stream back there)."""
    (scaler.scale(loss) if kind == "scaler" else loss).backward()
    if delay is not None:
        delay()
    if kind == "clip":  # moves the versions
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    elif kind == "data":  # moves no version: the checksums see it
        for p in model.parameters():
            p.grad.data.mul_(0.5)


def zero_refuses(device: str, kind: str, tmp_path, delay=None) -> None:
    """ZeRO (overlap=True) refuses a step whose gradients ``kind`` changed after backward, on
    its first step; the optimizer stays usable (two plain steps after)."""
    with world_of_one(tmp_path, "nccl" if device == "cuda" else "gloo"):
        model = make_models(device=device)
        opt = _zero(model, overlap=True)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
        _change(kind, model, model(*make_batch(0, device=device))[1], scaler, delay)
        with pytest.raises(RuntimeError, match="data-parallel reduce bucket"):
            scaler.step(opt) if kind == "scaler" else opt.step()
        opt.zero_grad(set_to_none=True)
        for step in (1, 2):
            model(*make_batch(step, device=device))[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        opt.close()


def zero_untouched(device: str, tmp_path) -> None:
    """The must-pass twin: ZeRO with overlap=True and untouched gradients is bit-identical at
    every step to ZeRO with overlap=False (buckets filled in step()) fed clones of them."""
    with world_of_one(tmp_path, "nccl" if device == "cuda" else "gloo"):
        a, b = make_models(device=device), make_models(device=device)
        opt_a, opt_b = _zero(a, overlap=True), _zero(b, overlap=False)
        for step in range(STEPS):
            for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
                assert torch.equal(_bits(pa), _bits(pb)), (step, name)
            a(*make_batch(step, device=device))[1].backward()
            for pa, pb in zip(a.parameters(), b.parameters()):
                pb.grad = pa.grad.detach().clone()
            for opt in (opt_a, opt_b):
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
        opt_a.close(), opt_b.close()


@pytest.mark.parametrize("kind", ["clip", "data", "scaler"])
def test_zero_refuses_a_gradient_changed_after_its_bucket_was_filled(kind, tmp_path,
                                                                     one_thread):
    zero_refuses("cpu", kind, tmp_path)  # the old code stepped the unchanged gradients


def test_zero_with_untouched_gradients_steps_as_without_overlap(tmp_path, one_thread):
    zero_untouched("cpu", tmp_path)
