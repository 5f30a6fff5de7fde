"""Note [lane unscale]: under ``torch.amp.GradScaler`` the GPU lane's chunks (Note [gpu lane])
are speculated like the host chunks (Note [grad scaler overlap]): a lane chunk admitted before
the scaler's verdict unscales its own fp32 gradient copy as ``GradScaler.unscale_`` unscales
``p.grad`` (never ``p.grad`` itself), is rolled back from its device slot (Note [lane rollback
on the GPU]) on an inf/NaN step, which is skipped, and is rolled back and stepped again when the
scale differs or the clip coefficient is not 1. Before, lane chunks were never admitted under a
scaler: they waited for the verdict.

On the CPU the lane's "device" is the CPU (its fused Adam is torch's CPU kernel, its slots CPU
tensors), so the result must be torch's AdamW(fused=True) + GradScaler's bit for bit: the
reference and the loop are tests/optim/test_grad_scaler_overlap.py's (injected infs, the scale
growing every 2 finite steps and backing off on the skipped ones, clipping never / always /
alternately), 10 steps, params, both moments and step counts compared, and the speculated /
rolled-back counts of every step -- lane chunks now among them -- the decisions' model.
tests/optim/test_lane_grad_scaler_cuda.py runs the lane on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from models import make_batch
from optim.test_grad_scaler_overlap import (BIG, HP, INF_STEPS, SMALL, _admitted_done, _bits,
                                            _check, _model, plain_steps_after_a_scaler)
from tiermem.optim import HybridAdam, gpu_lane, speculate

LANE = dict(gpu_step_fraction=1.0)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("clip_regime", [None, "never", "always", "alternate"],
                         ids=["noclip", "never", "always", "alternate"])
@pytest.mark.parametrize("lane", [0.5, 1.0])
def test_lane_chunks_speculate_under_a_scaler_bit_for_bit(lane, clip_regime, tier, tmp_path,
                                                          one_thread):
    """gpu_step_fraction 0.5 and 1.0, every chunk offloaded, a slot for every chunk, infs on
    steps 3 and 6, clipping off / never / always / alternately, state in RAM or on NVMe: bit
    for bit AdamW + GradScaler, and every chunk, the lane's included, is speculated on the steps
    that speculate (all rolled back on a skipped or clipped step). Red on the old code: lane
    chunks were never admitted, so the counts fell short by the lane's chunks."""
    _check(torch.float32, 1.0, BIG, clip_regime, INF_STEPS,
           tmp_path=tmp_path if tier == "nvme" else None, gpu_step_fraction=lane)


@pytest.mark.parametrize("lane", [0.5, 1.0])
def test_lane_and_host_slots_share_a_small_budget(lane, one_thread):
    """Three slots: the lane's device slots and host slots between them (a lane chunk takes a
    host slot when no device slot is free); three chunks speculate per step, bit for bit."""
    _check(torch.float32, 1.0, SMALL, "alternate", INF_STEPS, gpu_step_fraction=lane)


def test_offload_half_with_the_lane(one_thread):
    """Half the params offloaded, half of those on the lane: the GPU side, host chunks and lane
    chunks together under the scaler."""
    _check(torch.float32, 0.5, BIG, None, INF_STEPS, gpu_step_fraction=0.5)


def test_bf16_params_lane_unscale_rounds_to_bf16(one_thread):
    """bf16 params, a scale of 3 * 2^k (an inexact reciprocal): the lane's fp32 copy is
    unscaled and rounded to bf16 as ``unscale_`` stores it in ``p.grad``, then widened."""
    _check(torch.bfloat16, 1.0, BIG, None, INF_STEPS, **LANE)


def test_no_budget_keeps_lane_chunks_waiting_for_the_verdict(monkeypatch, one_thread):
    """``rollback_bytes=0``: the lane's chunks wait for the verdict as before (nothing is
    speculated, nothing unscaled by the lane), bit for bit."""
    calls = []
    real = gpu_lane.unscale_lane_
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda *a: calls.append(1) or real(*a))
    _check(torch.float32, 1.0, 0, "alternate", INF_STEPS, **LANE)
    assert calls == []


def test_lane_unscales_its_copy_never_the_users_grad(monkeypatch, one_thread):
    """Reference and HybridAdam (every chunk on the lane) in lockstep: after backward, once every
    lane chunk has been stepped speculatively, every ``p.grad`` is still bit for bit the
    reference's scaled gradient (the lane unscaled only its copy); the params are the
    reference's after every step, skipped ones included."""
    calls = []
    real = gpu_lane.unscale_lane_
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda *a: calls.append(1) or real(*a))
    ref, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     rollback_bytes=BIG, **LANE)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
               for _ in range(2)]
    skipped = [0, 0]
    for step in range(10):
        idx, tgt = make_batch(step)
        for m, sc in zip((ref, model), scalers):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(idx, tgt)[1]
            sc.scale(loss * (1e30 if step == 4 else 1.0)).backward()  # step 4: inf, skipped
        if opt._spec.active:
            _admitted_done(opt)
            n_chunks = sum(opt.chunk_tiers().values())
            assert len(opt._spec._admitted_gpu) == n_chunks  # all speculated, in device slots
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_bits(p.grad), _bits(q.grad)), (step, name)
        for k, (o, sc) in enumerate(((ref_opt, scalers[0]), (opt, scalers[1]))):
            scale = sc.get_scale()
            sc.step(o)
            sc.update()
            skipped[k] += sc.get_scale() < scale
            o.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_bits(p), _bits(q)), (step, name)
    assert skipped[0] == skipped[1] >= 1 and calls  # the inf step skipped; the lane unscaled
    opt.close()


def test_a_plain_step_after_a_scaler_rolls_the_lane_chunks_back(one_thread):
    """A registered scaler, then plain ``opt.step()`` calls: lane chunks stepped during backward
    unscaled their copies by the scaler's scale, which this step was not given (the scale
    differs): rolled back from their device slots and stepped again from the gradients as they
    are, as AdamW steps them."""
    model, ref, opt, rolled = plain_steps_after_a_scaler(**LANE)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    n_chunks = sum(opt.chunk_tiers().values())
    assert len(opt._lane.chunks) == n_chunks and opt._lane.rollback  # device slots
    assert rolled == [n_chunks] * 5
    opt.close()


# ---------------------------------------------------------------- must-fail twins


def test_a_lane_that_steps_the_scaled_gradient_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the lane does not unscale its copy (it steps the scaled gradient)."""
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda pieces, scale: None)
    assert not _check(torch.float32, 1.0, BIG, None, {}, expect_red=True, **LANE)


def test_a_lane_unscale_without_the_rounding_to_bf16_is_caught(monkeypatch, one_thread):
    """Must-fail twin: bf16 gradients unscaled in fp32 and not rounded to bf16 (the lane's
    copy is fp32, so without the rounding it would read a product ``unscale_`` never made)."""
    def fp32_only(pieces, scale):
        gpu_lane.torch._amp_foreach_non_finite_check_and_unscale_(
            [t for t, _ in pieces], torch.zeros(()), scale.double().reciprocal().float())

    monkeypatch.setattr(gpu_lane, "unscale_lane_", fp32_only)
    assert not _check(torch.bfloat16, 1.0, BIG, None, {}, expect_red=True, **LANE)


def test_a_stale_lane_slot_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the lane's pre-step copy goes to a throwaway tensor, so its device slot
    keeps an older step's state, which the inf steps' rollback restores."""
    real = speculate.Speculation.lane_copy

    def stale(self, item):
        keep = real(self, item)
        if keep is not None and not keep[1]:
            return torch.empty_like(keep[0]), False  # the copy never reaches the slot
        return keep

    monkeypatch.setattr(speculate.Speculation, "lane_copy", stale)
    assert not _check(torch.float32, 1.0, BIG, None, INF_STEPS, expect_red=True, **LANE)


def test_a_lane_scale_not_compared_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the lane's scale is never handed to ``step()``, so a step given another
    scale (a plain ``opt.step()``) keeps lane chunks that unscaled by the scaler's."""
    monkeypatch.setattr(speculate.Speculation, "lane_scale_read",
                        lambda self, item, host, event: None)
    with pytest.raises(AssertionError):
        test_a_plain_step_after_a_scaler_rolls_the_lane_chunks_back(None)
