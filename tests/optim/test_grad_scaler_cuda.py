"""HybridAdam in a CUDA fp16 loop with torch.amp.GradScaler (Note [grad scaler]): refused
clearly when a scaler appears after overlapped steps, and with gradients handed over in
``step()`` (``overlap=False``, or ``max_grad_norm``) as AdamW + GradScaler.

Reference: ``torch.optim.AdamW(fused=True)`` with its own GradScaler on a copy of the same fp32
model (autocast fp16 forward, ``growth_interval=1`` so the scale doubles until gradients
overflow and steps are skipped). The skipped steps must be the same ones. HybridAdam's CPU
kernel may round a value one ulp off torch's CUDA kernel and the fp16 forward amplifies that,
so the weights are compared within ``NOISE_MULTIPLE`` times the drift of another correct
implementation of the same update (``AdamW(foreach=True)``, same scaler) from the reference,
floored at ``FLOOR`` relative; the tolerance is shown to fail on the old overlap=True result
(``_ScaledAdamW``: the CPU side stepping the scaled gradients, skipping what the scaler skips),
which must fall outside it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 12
NOISE_MULTIPLE = 4.0
FLOOR = 1e-5  # relative L2 of the params: far below the old result's distance (checked below)
SHAPE = dict(vocab=256, d_model=128, n_heads=4, n_layers=4, seq_len=64)


def _batch(step, device):
    return make_batch(step, batch=4, seq_len=SHAPE["seq_len"], vocab=SHAPE["vocab"],
                      device=device)


class _ScaledAdamW(torch.optim.AdamW):
    """The old overlap=True result: AdamW stepping the *scaled* gradients (GradScaler.step
    unscaled them by a power of two, so multiplying by the scale again is exact), skipping
    what the scaler skips."""

    scale = 1.0

    def step(self, closure=None):
        torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"]
                             if p.grad is not None], self.scale)
        return super().step(closure)


def _loop(model, opt, device="cuda", steps=STEPS):
    """fp16 autocast steps under a GradScaler; the steps it skipped."""
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=1)
    skipped = []
    for step in range(steps):
        idx, tgt = _batch(step, device)
        with torch.autocast(device, dtype=torch.float16):
            _, loss = model(idx, tgt)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        if isinstance(opt, _ScaledAdamW):
            opt.scale = scale
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        opt.zero_grad(set_to_none=True)
    return skipped


def _flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _models(device):
    torch.manual_seed(0)
    base = TinyGPT(**SHAPE).to(device)
    return base, [copy.deepcopy(base) for _ in range(3)]


def _reference(device):
    """The reference's flat params and skipped steps, the noise (foreach vs fused AdamW), and
    the old overlap=True result's distance (the tolerance must fail there)."""
    ref, (foreach, old, _) = _models(device)
    skipped = _loop(ref, torch.optim.AdamW(ref.parameters(), **HP, fused=True), device)
    assert _loop(foreach, torch.optim.AdamW(foreach.parameters(), **HP, foreach=True),
                 device) == skipped
    _loop(old, _ScaledAdamW(old.parameters(), **HP, fused=True), device)
    want = _flat(ref)
    noise = float((_flat(foreach) - want).norm())
    bound = max(NOISE_MULTIPLE * noise, FLOOR * float(want.norm()))
    assert float((_flat(old) - want).norm()) > bound  # the tolerance fails the old result
    return want, skipped, bound


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kw", [{"overlap": False}, {"max_grad_norm": 1e6}])
def test_cuda_grad_scaler_steps_as_adamw_with_its_skipped_steps(fraction, kw):
    want, skipped, bound = _reference("cuda")
    assert 1 <= sum(skipped) <= STEPS // 2 and not skipped[0]
    _, (model, _, _) = _models("cuda")
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, **kw)
    assert _loop(model, opt) == skipped
    distance = float((_flat(model) - want).norm())
    assert distance <= bound, (distance, bound)
    opt.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_grad_scaler_first_seen_after_overlapped_steps_is_refused(fraction):
    """Three plain steps (the first traces, the next two step chunks during backward:
    Note [grad scaler overlap]), then a scaler: the CPU side has stepped scaled gradients with
    no way back, refused naming the fix. (A scaler from the first step is exact:
    tests/optim/test_grad_scaler_overlap_cuda.py.)"""
    _, (model, _, _) = _models("cuda")
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction)
    for step in range(3):
        idx, tgt = _batch(100 + step, "cuda")
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"GradScaler steps this optimizer.*overlap=False"):
        _loop(model, opt, steps=1)
    opt.close()


def _data_write_after_backward(device, fraction):
    """8 plain steps (no scaler; no false alarm), the last with ``p.grad.data.mul_(0.5)`` on
    the LM head's gradient after backward: refused in step() by the checksums taken on the
    device at the hand-over (Note [gradient checksums])."""
    _, (model, _, _) = _models(device)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction)
    head = list(model.parameters())[-1]
    for step in range(8):
        idx, tgt = _batch(step, device)
        model(idx, tgt)[1].backward()
        if step < 7:
            opt.step()
        else:
            head.grad.data.mul_(0.5)
            with pytest.raises(RuntimeError, match=r"changed after backward had already copied"):
                opt.step()
        opt.zero_grad(set_to_none=True)
    opt.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_a_grad_data_write_after_backward_is_refused(fraction):
    _data_write_after_backward("cuda", fraction)
