"""Note [grad scaler overlap] on CUDA: HybridAdam with ``overlap=True`` and a rollback budget
under torch.amp.GradScaler steps offloaded chunks during backward (each chunk's gradient copy
unscaled on the host as ``GradScaler.unscale_`` unscales ``p.grad``), puts them back on a
skipped (inf/NaN) step and on a clipped one, against torch's AdamW(fused=True) + GradScaler:
(a)/(b) an fp16 loop whose scale doubles every step until gradients overflow (finite and
skipped steps), (c) ``max_grad_norm`` never / always / alternately clipping, the reference
clipping as torch's docs show (``scaler.unscale_``, ``clip_grad_norm_``).

Not bit for bit here: the offloaded chunks step with the native CPU kernel and the GPU side
with torch's fused CUDA kernel, which round some values one ulp apart (fma contraction, the
division), and the fp16 forward amplifies that (tests/test_cuda_training_parity.py's matrix
has the same tolerance): the weights must lie within ``NOISE_MULTIPLE`` times the drift of
another correct implementation (``AdamW(foreach=True)``, same scaler) from the reference,
floored at ``FLOOR`` relative, and the tolerance is shown to fail on a wrong result (AdamW
stepping the scaled gradients: what a chunk that is not unscaled or not rolled back steps).
The unscale itself is the same fp32 multiply on the host as on the device. The skipped steps
must be the same; the step statistics must show the speculation and its rollbacks.
"""

from __future__ import annotations

import time

import pytest
import torch

from optim.test_grad_scaler_cuda import FLOOR, HP, NOISE_MULTIPLE, STEPS, _batch, _flat, _models
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda

BIG = 1 << 30
# regime -> (max_grad_norm, loss factor per step)
REGIMES = {
    "none": (None, lambda s: 1.0),
    "never": (1e6, lambda s: 1.0),
    "always": (1e-3, lambda s: 1.0),
    "alternate": (1.0, lambda s: 8.0 if s % 2 else 0.01),
}


class _ScaledAdamW(torch.optim.AdamW):
    """A wrong result: AdamW stepping the gradients times the scale (exact: a power of two)."""

    scale = 1.0

    def step(self, closure=None):
        torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"]
                             if p.grad is not None], self.scale)
        return super().step(closure)


def _drain(opt, limit_s=120.0):
    """Wait (bounded) until the worker has stepped every chunk it was given this step (each
    holds a rollback slot), so the counts do not depend on the timing."""
    step = opt._step
    end = time.monotonic() + limit_s
    with step.idle:
        while step.outstanding and time.monotonic() < end:
            step.idle.wait(1.0)


def _loop(model, opt, regime, device):
    """fp16 autocast steps under a GradScaler (``growth_interval=1``); returns (skipped,
    norms of the reference's clip, step_stats of HybridAdam)."""
    max_norm, factor = REGIMES[regime]
    hybrid = isinstance(opt, HybridAdam)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=1)
    skipped, norms, stats = [], [], []
    for step in range(STEPS):
        idx, tgt = _batch(step, device)
        with torch.autocast(device, dtype=torch.float16):
            _, loss = model(idx, tgt)
        scaler.scale(loss * factor(step)).backward()
        scale = scaler.get_scale()
        if hybrid and opt._spec.active:
            _drain(opt)
        if max_norm is not None and not hybrid:
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        if isinstance(opt, _ScaledAdamW):
            opt.scale = scale
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        if hybrid:
            stats.append(opt.step_stats())
        opt.zero_grad(set_to_none=True)
    return skipped, norms, stats


def _check(regime, fraction, device="cuda"):
    ref, (foreach, wrong, model) = _models(device)
    skipped, norms, _ = _loop(ref, torch.optim.AdamW(ref.parameters(), **HP, fused=True),
                              regime, device)
    assert _loop(foreach, torch.optim.AdamW(foreach.parameters(), **HP, foreach=True),
                 regime, device)[0] == skipped
    _loop(wrong, _ScaledAdamW(wrong.parameters(), **HP, fused=True), regime, device)
    want = _flat(ref)
    noise = float((_flat(foreach) - want).norm())
    bound = max(NOISE_MULTIPLE * noise, FLOOR * float(want.norm()))
    assert float((_flat(wrong) - want).norm()) > bound  # the tolerance fails a wrong result
    assert any(skipped) and not all(skipped)  # finite and skipped steps
    max_norm = REGIMES[regime][0]
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, rollback_bytes=BIG,
                     max_grad_norm=max_norm)
    got, _, stats = _loop(model, opt, regime, device)
    opt.close()
    assert got == skipped
    distance = float((_flat(model) - want).norm())
    spec = [s["speculated_chunks"] for s in stats]
    rolled = [s["rolled_back_chunks"] for s in stats]
    assert distance <= bound, (distance, bound, skipped, norms, spec, rolled)
    assert spec[0] == 0 and sum(spec) > 0  # step 0 traces; later steps speculate
    for s in range(STEPS):
        clipped = max_norm is not None and not skipped[s] and norms[s] > max_norm
        if skipped[s] or clipped:
            assert rolled[s] == spec[s], (s, spec, rolled)
        elif max_norm is None or norms[s] < max_norm - 1e-3:
            assert rolled[s] == 0, (s, spec, rolled)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_overlap_under_a_scaler_steps_as_adamw_with_its_skipped_steps(fraction):
    """(a) and (b): finite steps stand, skipped steps roll every speculated chunk back."""
    _check("none", fraction)


@pytest.mark.parametrize("regime", ["never", "always", "alternate"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cuda_clipping_under_a_scaler_speculates(regime, fraction):
    """(c): the norm of the unscaled gradients, clipped steps rolled back."""
    _check(regime, fraction)
