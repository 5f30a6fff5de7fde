"""Note [lane unscale] on CUDA: the GPU lane's chunks (Note [gpu lane]) speculated under
torch.amp.GradScaler -- each admitted lane chunk unscales its fp32 gradient copy on the lane
stream by a snapshot of the scaler's scale, is rolled back from its device slot (Note [lane
rollback on the GPU]) on a skipped (inf/NaN) step and rolled back and stepped again on a
clipped one -- against torch's AdamW(fused=True) + GradScaler, 12 fp16-autocast steps whose
scale doubles every step until gradients overflow (finite and skipped steps), ``max_grad_norm``
off / never / always / alternately clipping (the reference clipping as torch's docs show).

Tolerance as tests/optim/test_grad_scaler_overlap_cuda.py derives it (its loop, models and
bound): within ``NOISE_MULTIPLE`` times the drift of another correct implementation
(``AdamW(foreach=True)``, same scaler) from the reference, floored at ``FLOOR`` relative; the
bound is shown to fail AdamW stepping the scaled gradients, and the lane with its unscale
switched off (the must-fail twin: what the old code would have stepped had it admitted lane
chunks) must fall outside it. The skipped steps must be the reference's; the step statistics
must count the lane's chunks among the speculated and rolled-back ones.
"""

from __future__ import annotations

import pytest
import torch

from optim.test_grad_scaler_cuda import FLOOR, HP, NOISE_MULTIPLE, STEPS, _flat, _models
from optim.test_grad_scaler_overlap_cuda import BIG, REGIMES, _loop, _ScaledAdamW
from tiermem.optim import HybridAdam, gpu_lane

pytestmark = pytest.mark.cuda

CHUNK = 1 << 15  # ~27 chunks of the test model: a lane share of 0.5 has some


def _reference(regime, device="cuda"):
    """(want, skipped, norms, bound): the reference's flat params, its skipped steps and clip
    norms, and the tolerance (shown to fail AdamW stepping the scaled gradients)."""
    ref, (foreach, wrong, _) = _models(device)
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
    return want, skipped, norms, bound


def _train(regime, lane, offload=1.0, device="cuda"):
    """HybridAdam with the lane under the scaler: (model, skipped, stats, lane chunks, chunks,
    the lane's device rollback slots)."""
    _, (model, _, _) = _models(device)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=offload, chunk_numel=CHUNK,
                     rollback_bytes=BIG, max_grad_norm=REGIMES[regime][0],
                     gpu_step_fraction=lane)
    got, _, stats = _loop(model, opt, regime, device)
    n_lane, n_chunks = len(opt._lane.chunks), sum(opt.chunk_tiers().values())
    gpu_slots = len(opt._lane.rollback)
    opt.close()
    return model, got, stats, n_lane, n_chunks, gpu_slots


@pytest.mark.parametrize("regime", ["none", "never", "always", "alternate"])
@pytest.mark.parametrize("lane", [0.5, 1.0])
def test_cuda_lane_chunks_speculate_under_a_scaler(regime, lane):
    want, skipped, norms, bound = _reference(regime)
    model, got, stats, n_lane, n_chunks, gpu_slots = _train(regime, lane)
    assert got == skipped
    distance = float((_flat(model) - want).norm())
    assert distance <= bound, (distance, bound)
    assert n_lane >= 2 and gpu_slots == n_lane  # every lane chunk has a device slot
    spec = [s["speculated_chunks"] for s in stats]
    rolled = [s["rolled_back_chunks"] for s in stats]
    gpu_chunks = [s["gpu_chunks"] for s in stats]
    assert spec[0] == 0 and max(spec) == n_chunks, spec  # the lane's chunks are counted
    max_norm = REGIMES[regime][0]
    for s in range(STEPS):
        clipped = max_norm is not None and not skipped[s] and norms[s] > max_norm
        if spec[s]:
            assert spec[s] == n_chunks, (s, spec)  # the lane's among them (_loop drains)
        if skipped[s] or clipped:
            assert rolled[s] == spec[s], (s, spec, rolled)
            if not skipped[s]:  # rolled back and stepped again: the lane's chunks twice
                assert gpu_chunks[s] == n_lane + (n_lane if spec[s] else 0), (s, gpu_chunks)
        elif max_norm is None or norms[s] < max_norm - 1e-3:
            assert rolled[s] == 0, (s, spec, rolled)


def test_cuda_lane_without_its_unscale_is_outside_the_tolerance(monkeypatch):
    """Must-fail twin: the lane steps the scaled gradient copy (its unscale a no-op): the
    weights leave the tolerance the correct run stays within."""
    want, skipped, _, bound = _reference("none")
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda pieces, scale: None)
    model, got, _, _, _, _ = _train("none", 1.0)
    assert got == skipped
    distance = float((_flat(model) - want).norm())
    assert distance > bound, (distance, bound)
