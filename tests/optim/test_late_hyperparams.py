"""Note [late hyper-parameters]: a loop that sets ``param_groups`` values after backward and
before ``step()`` (build-nanogpt's ``lr`` schedule) trains as torch.optim.AdamW does: HybridAdam
holds its chunks until ``step()`` from the step where it sees that, and refuses a step whose
chunks were already stepped with other values instead of applying it silently."""

from __future__ import annotations

import logging

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, assert_params_close, make_models
from tiermem.optim import HybridAdam
from tiermem.optim import hybrid_adam as hybrid_adam_module

STEPS = 8


def _lr(step: int) -> float:
    """A warmup-then-decay schedule whose first value differs from ``HP["lr"]`` (as
    build-nanogpt's ``get_lr(0)`` differs from the optimizer's lr)."""
    return HP["lr"] * min(1.0, (step + 1) / 4) / (1 + 0.1 * step)


def _train(model, opt, *, accum: int = 2, drain: bool = False, late_from: int = 0):
    """``STEPS`` steps; from step ``late_from`` on the lr is set after backward and before
    ``step()`` (before that: before the forward). ``drain``: wait for the worker's chunks
    after backward (the chunks stepped during backward, deterministically)."""
    losses = []
    for step in range(STEPS):
        if step < late_from:
            for group in opt.param_groups:
                group["lr"] = _lr(step)
        total = 0.0
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            _, loss = model(idx, tgt)
            (loss / accum).backward()
            total += loss.item() / accum
        if drain:
            opt._step.drain()
        if step >= late_from:
            for group in opt.param_groups:
                group["lr"] = _lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _pair(**kw):
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, **{"offload_fraction": 1.0, "chunk_numel": 1024,
                                                  "grad_accumulation_steps": 2, **kw})
    return ref, ref_opt, model, opt


CASES = {
    "overlap": {},
    "forward_sync": {"param_sync": "forward"},
    "lane": {"gpu_step_fraction": 1.0},
    "half_offloaded": {"offload_fraction": 0.5},
    "clip_speculating": {"max_grad_norm": 1.0, "rollback_bytes": 1 << 20},
}


@pytest.mark.parametrize("case", list(CASES))
def test_lr_set_after_backward_trains_as_adamw(case, caplog):
    kw = dict(CASES[case])
    ref, ref_opt, model, opt = _pair(**kw)
    clip = kw.get("max_grad_norm")
    ref_losses = []
    for step in range(STEPS):  # the reference: AdamW with the same late lr (and clip)
        total = 0.0
        for micro in range(2):
            idx, tgt = make_batch(step * 2 + micro)
            _, loss = ref(idx, tgt)
            (loss / 2).backward()
            total += loss.item() / 2
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        for group in ref_opt.param_groups:
            group["lr"] = _lr(step)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(total)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        losses = _train(model, opt)
    opt.synchronize()
    assert losses == ref_losses
    assert_params_close(model, ref, exact=True)
    held = [r for r in caplog.records if "changes hyper-parameters after backward" in r.message]
    assert len(held) == 1 and "param_groups[0]['lr']" in held[0].getMessage()
    assert opt._late_hp
    opt.close()


def test_the_twin_without_the_hold_steps_chunks_with_the_old_lr(monkeypatch):
    """Must go red: the hold and the refusal taken out, chunks the worker stepped during
    backward keep the previous step's lr, and the run leaves AdamW's."""
    monkeypatch.setattr(hybrid_adam_module, "hold_for_late_hyperparams", lambda *a: False)
    monkeypatch.setattr(hybrid_adam_module, "refuse_stale_hyperparams", lambda *a: None)
    ref, ref_opt, model, opt = _pair()
    _train(ref, ref_opt)
    _train(model, opt, drain=True)
    opt.synchronize()
    with pytest.raises(AssertionError):
        assert_params_close(model, ref, exact=False)
    opt.close()


def test_chunks_already_stepped_with_another_lr_refuse_the_step(caplog):
    """The lr changes after backward only from step 3 (the first steps set it before the
    forward): step 3's chunks were stepped with step 2's lr, so that step is refused in one
    line naming the field and both values; later steps hold the chunks and run."""
    _, _, model, opt = _pair()
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] .* -> .*restart "
                                               r"from a checkpoint"):
            _train(model, opt, drain=True, late_from=3)
    assert opt._late_hp
    opt.zero_grad(set_to_none=True)
    for step in range(3):  # usable: the lr set after backward every step, no error
        for micro in range(2):
            idx, tgt = make_batch(100 + 2 * step + micro)
            model(idx, tgt)[1].backward()
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_a_scheduler_stepped_after_step_keeps_the_overlap(caplog):
    """The usual loop (scheduler.step() after opt.step()) is not held: no warning, no hold,
    and the result is AdamW's."""
    ref, ref_opt, model, opt = _pair()
    _train(ref, ref_opt, late_from=STEPS)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _train(model, opt, late_from=STEPS)
    opt.synchronize()
    assert not opt._late_hp
    assert not [r for r in caplog.records if "hyper-parameters" in r.message]
    assert_params_close(model, ref, exact=True)
    opt.close()
