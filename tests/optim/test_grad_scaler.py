"""HybridAdam in an fp16 loop with torch.amp.GradScaler (Note [grad scaler]), and gradients
changed after backward behind the version counters (Note [gradient checksums]).

The reference is torch.optim.AdamW(fused=True) driven by its own GradScaler on a copy of the
same model: the same batches, autocast fp16 forward, ``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()``; ``growth_interval=1`` doubles the scale every step until
the fp16 activations' gradients overflow, so the loop has skipped steps like a real fp16 run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 12


def scaled_loop(model, opt, steps, init_scale, clip=None, device="cpu"):
    """``steps`` fp16 autocast steps under a GradScaler; returns which steps it skipped
    (found inf/NaN: the scale fell)."""
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=1)
    skipped = []
    for step in range(steps):
        idx, tgt = make_batch(step)
        with torch.autocast(device, dtype=torch.float16):
            _, loss = model(idx.to(device), tgt.to(device))
        scaler.scale(loss).backward()
        if clip is not None:  # the reference clips as torch's docs show
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        opt.zero_grad(set_to_none=True)
    return skipped


def models(device="cpu"):
    torch.manual_seed(0)
    ref = TinyGPT().to(device)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("kw,clip", [({"overlap": False}, None),
                                     ({"max_grad_norm": 0.5}, 0.5)])
def test_grad_scaler_steps_as_with_adamw_through_skipped_steps(tmp_path, fraction, kw, clip):
    """Gradients handed over in step() (overlap=False, or clipping without speculation): the
    scaler's unscale and its skipped steps give AdamW + GradScaler's weights bit for bit, over
    12 steps with skipped ones (before: the step after the first skipped one refused "2
    backward passes accumulated" -- the skipped step() left the backward counted)."""
    ref, model = models()
    want = scaled_loop(ref, torch.optim.AdamW(ref.parameters(), **HP, fused=True), STEPS,
                       2.0 ** 12, clip)
    assert 1 <= sum(want) <= STEPS // 2 and not want[0]  # the loop skips a few steps
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=1024,
                     state_tier="nvme", nvme_dir=str(tmp_path), **kw)
    assert scaled_loop(model, opt, STEPS, 2.0 ** 12) == want
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    opt.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("placement,init_scale", [("trace", 2.0 ** 12), ("given", 2.0 ** 40)])
def test_grad_scaler_with_overlap_holds_the_chunks_for_the_verdict(
        fraction, placement, init_scale):
    """overlap=True with a scaler from the first step and no rollback budget: the chunks are
    handed over in backward and wait for step()'s verdict (Note [grad scaler overlap]), so the
    12 steps, skipped ones included, are AdamW + GradScaler's bit for bit; with
    placement="given" and an overflowing scale the very first step is skipped (before: step 2,
    or with "given" step 1, was refused -- "backward had already handed scaled gradients")."""
    ref, model = models()
    want = scaled_loop(ref, torch.optim.AdamW(ref.parameters(), **HP, fused=True), STEPS,
                       init_scale)
    assert any(want) and (want[0] == (init_scale > 2 ** 30))
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=1024,
                     placement=placement)
    assert scaled_loop(model, opt, STEPS, init_scale) == want
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    opt.close()


def test_a_refused_scaler_step_leaves_the_optimizer_usable():
    """A scaler first seen after steps that stepped chunks during backward is refused (Note
    [grad scaler]); the refusal drops the scaler's ``grad_scale`` and ``found_inf`` (torch
    deletes them only when step() returns): the optimizer trains on without a scaler."""
    _, model = models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    for step in range(3):  # the first traces; then chunks step during backward
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"GradScaler steps this optimizer, but backward had "
                                           r"already handed scaled gradients .*overlap=False"):
        scaled_loop(model, opt, 1, 2.0 ** 12)
    # the scaler deletes them only when step() returns; the refusal did (Note [grad scaler])
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    for step in range(3):
        idx, tgt = make_batch(100 + step)
        model(idx, tgt)[1].backward()
        opt.step()  # the scaler's leftover attributes are not taken again
        opt.zero_grad(set_to_none=True)
    opt.close()


def test_an_fp16_gradient_refused_under_a_scaler_leaves_nothing_behind():
    """fp16 gradients under a scaler are refused (Note [grad scaler]); the refusal is no step:
    the scaler's ``grad_scale`` and ``found_inf`` are dropped (its next step would multiply the
    former into its scale) and the scaler is not registered (before: the next steps held for
    a scaler that never drives one)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).half()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.randn(4, 64).half()).float().pow(2).mean()).backward()
    with pytest.raises(ValueError, match=r"GradScaler: a gradient is fp16"):
        scaler.step(opt)
    amp = opt._spec.amp
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert (amp.stepped, amp.seen, amp.scaler()) == (False, False, None)
    opt.close()


@pytest.mark.parametrize("change", ["grad_data_mul", "unscale_kernel", "scaler_unscale"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_gradient_change_no_version_sees_is_refused(change, fraction):
    """A write to a handed-over gradient through ``p.grad.data`` or by GradScaler's unscale
    kernel (``scaler.unscale_(opt)`` then ``opt.step()`` without the scaler) moves no version
    counter; the checksums taken at the hand-over refuse it in step() (before: stepped
    silently, the CPU side with the gradients as they were at the hand-over). 8 steps, the
    change in the last one; the steps before it run clean (no false alarm)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=1024)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    last = [p for p in model.parameters()][-1]  # the LM head: offloaded at either fraction
    for step in range(8):
        idx, tgt = make_batch(step)
        scaler.scale(model(idx, tgt)[1]).backward()
        if step == 7 and change == "grad_data_mul":
            last.grad.data.mul_(0.5)
        elif step == 7 and change == "unscale_kernel":
            torch._amp_foreach_non_finite_check_and_unscale_(
                [last.grad], torch.zeros(()), torch.full((), 0.125))
        elif step == 7:
            scaler.unscale_(opt)
        if step == 7:
            with pytest.raises(RuntimeError, match=r"changed after backward had already "
                                                   r"copied it .*p\.grad\.data"):
                opt.step()
        else:
            opt.step()  # no scaler.step: HybridAdam steps the scaled gradients, no refusal
        opt.zero_grad(set_to_none=True)
    opt.close()


def test_sums_are_taken_only_for_gradients_handed_over_in_backward(monkeypatch):
    """Note [gradient checksums]: two sums per gradient handed over during backward (at the
    hand-over and in step()), none for gradients handed over in step() (overlap=False, the
    first traced step)."""
    calls = []
    import tiermem.optim.grad_sums as grad_sums  # here: the module is new (the old code runs)
    real = grad_sums.checksum
    monkeypatch.setattr(grad_sums, "checksum", lambda t: calls.append(t.numel()) or real(t))
    for overlap in (False, True):
        torch.manual_seed(0)
        model = TinyGPT()
        opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                         overlap=overlap)
        per_step = []
        for step in range(8):
            idx, tgt = make_batch(step)
            calls.clear()
            model(idx, tgt)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            per_step.append(len(calls))
        n = len(list(model.parameters()))
        assert per_step == ([0] * 8 if not overlap else [0] + [2 * n] * 7), overlap
        opt.close()
