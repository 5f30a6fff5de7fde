"""Note [skipped steps]: ``opt.zero_grad()`` after a backward without ``step()`` skips the step
as torch.optim.AdamW does where nothing of it could be stepped yet (held or speculated chunks),
and refuses in one line where chunks could be stepped during backward."""

from __future__ import annotations

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, assert_params_close, make_models
from tiermem.optim import HybridAdam
from tiermem.optim.speculate import Speculation

STEPS = 8
SKIPS = (3, 5)


def _run(model, opt, *, clip=None, accum=2, skip_at_micro=None):
    """``STEPS`` steps of ``accum`` micro-batches; steps in ``SKIPS`` are skipped with
    ``opt.zero_grad()`` after their last backward (or after micro-batch ``skip_at_micro``).
    ``clip``: torch's clip_grad_norm_ (the AdamW reference only)."""
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            _, loss = model(idx, tgt)
            (loss / accum).backward()
            total += loss.item() / accum
            if step in SKIPS and micro == skip_at_micro:
                break
        losses.append(total)
        if step in SKIPS:
            opt.zero_grad(set_to_none=True)  # the loop skips this batch
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


HELD = {
    "clip_waiting": dict(max_grad_norm=0.5),
    "clip_speculating": dict(max_grad_norm=0.5, rollback_bytes=1 << 20),
    "no_overlap": dict(overlap=False),
    "first_micro_batch": dict(),  # skipped after micro-batch 0 of 2: nothing handed over yet
    "lane_speculating": dict(max_grad_norm=1e6, rollback_bytes=1 << 20, gpu_step_fraction=1.0),
}


@pytest.mark.parametrize("case", list(HELD))
def test_a_skip_with_nothing_stepped_yet_is_adamws_skip(case):
    kw = dict(HELD[case])
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     grad_accumulation_steps=2, **kw)
    micro = 0 if case == "first_micro_batch" else None
    ref_losses = _run(ref, ref_opt, clip=kw.get("max_grad_norm"), skip_at_micro=micro)
    losses = _run(model, opt, skip_at_micro=micro)
    opt.synchronize()
    assert losses == ref_losses
    assert_params_close(model, ref, exact=True)
    opt.close()


def test_the_twin_that_keeps_speculated_chunks_leaves_adamw(monkeypatch):
    """Must go red: the skip's speculated chunks not put back (``Speculation.undo`` a no-op),
    the skipped batch's update stays in them."""
    monkeypatch.setattr(Speculation, "undo", lambda self: None)
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     grad_accumulation_steps=2, max_grad_norm=1e6, rollback_bytes=1 << 20)
    _run(ref, ref_opt, clip=1e6)
    _run(model, opt)
    opt.synchronize()
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, exact=False)
    opt.close()


def test_a_skip_after_an_overlapped_backward_is_refused_and_the_optimizer_stays_usable():
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    for step in range(2):
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    idx, tgt = make_batch(10)
    model(idx, tgt)[1].backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after backward without step\(\).*"
                                           r"restart from a checkpoint"):
        opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())  # the gradients were reset first
    for step in range(3):  # the next steps run, without the accumulation refusal
        idx, tgt = make_batch(20 + step)
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_model_zero_grad_skips_are_named_at_the_next_step():
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     max_grad_norm=1.0)
    for step in range(2):
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        if step == 1:
            with pytest.raises(RuntimeError, match=r"opt\.zero_grad\(\), not model\.zero_grad"):
                opt.step()
            break
        model.zero_grad(set_to_none=True)  # bypasses the optimizer: not a skip it can see
    opt.close()
