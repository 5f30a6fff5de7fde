"""Note [streamed grad scaler] on a GPU: the CUDA twin of tests/stream/test_stream_grad_scaler.py.
The streamed weights' gradients are host tensors while the scale lives on the GPU, so the
scaler is :class:`StreamedGradScaler` (torch's own is refused: its host copies of the scale race
its CPU kernel), and a speculated chunk's scale is copied D2H even when the chunk has no device
gradient (its streamed pieces are copied host to host into the ring).

Reference: the same GPT from the same seed, not streamed, on the GPU, trained by torch's
AdamW(fused=True) under torch's GradScaler (every gradient on the GPU: no race), through the
same schedule; ``scaler.unscale_`` + ``clip_grad_norm_`` where it clips. fp32 weights, the loss
scaled (``growth_interval=1``: the scale doubles every finite step), infs injected into a
streamed weight's gradient (step 3) and the LM head's (step 6). Not bit for bit: the offloaded
chunks step with the native CPU kernel, the reference with torch's fused CUDA kernel (one ulp
apart on some values). So the tolerance is the reference's own noise, as
tests/optim/test_grad_scaler_overlap_cuda.py takes it: another correct run (AdamW(foreach=True),
same scaler) against the reference, ``NOISE_MULTIPLE`` times, floored at ``FLOOR`` relative --
for the loss of every one of 10 steps and for the final weights; the skipped steps must be the
reference's; and the tolerance must fail a wrong run (AdamW stepping the scaled gradients, whose
moments mix the scales: what a chunk stepped without the unscale does).
"""

from __future__ import annotations

import pytest
import torch

from optim.test_grad_scaler_cuda import FLOOR, NOISE_MULTIPLE
from tiermem.optim.amp_scaling import StreamedGradScaler
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import batches, make_model
from test_stream_grad_scaler import BIG, CHUNK, CLIPS, CONFIGS, HP, INF_STEPS, STEPS, _wait_worker

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme)``: a CUDA store, 1 MiB GPU budget, 8 MiB RAM; ``nvme``: 64 MiB NVMe."""
    return lambda nvme: make_stream_store(device=DEVICE, gpu_bytes=1 << 20, cpu_bytes=8 << 20,
                                          **({"nvme_bytes": 64 << 20} if nvme else {}))


class _ScaledAdamW(torch.optim.AdamW):
    """A wrong result: AdamW stepping the gradients times the scale (a power of two: exact)."""

    scale = 1.0

    def step(self, closure=None):
        torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"]
                             if p.grad is not None], self.scale)
        return super().step(closure)


def _loop(model, opt, scaler, clip, n_micro, major):
    """``STEPS`` steps on the GPU; returns (each step's micro-batch losses as fp64 on the host,
    the steps skipped, HybridAdam's step_stats)."""
    max_norm, factor = CLIPS[clip]
    hybrid = isinstance(opt, HybridAdam)
    output = model.output
    cur = {"step": 0}

    def scaled_output(x, targets=None):
        logits, loss = output(x, targets)
        return logits, scaler.scale(loss * factor(cur["step"]))

    model.output = scaled_output
    named = dict(model.named_parameters())
    poison = {"on": None}
    for _, name in INF_STEPS:
        named[name].register_hook(
            lambda g, n=name: g * float("inf") if poison["on"] == n else g)
    losses, skipped, stats = [], [], []
    for step in range(STEPS):
        cur["step"] = step
        poison["on"] = dict(INF_STEPS).get(step)
        scale = scaler.get_scale()
        mbs = [(i.to(DEVICE), t.to(DEVICE)) for i, t in batches(step, n_micro)]
        got = forward_backward(model, mbs, block_major=major)
        losses.append(torch.stack(got).double().cpu() / scale)  # the unscaled losses
        if hybrid and opt._spec.active:
            _wait_worker(opt)
        if max_norm is not None and not hybrid:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if isinstance(opt, _ScaledAdamW):
            opt.scale = scale
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        opt.zero_grad(set_to_none=True)
        if hybrid:
            opt.synchronize()
            stats.append(opt.step_stats())
    return losses, skipped, stats


def _flat(model):
    return torch.cat([p.detach().double().cpu().reshape(-1) for p in model.parameters()])


def _scaler(cls):
    return cls(DEVICE, init_scale=2.0 ** 12, growth_interval=1)


def _reference(clip, n_micro, major):
    """The reference's (losses, flat weights, skipped), the loss bound of every step and the
    weights' bound, each shown to fail the wrong run."""
    runs = {}
    for kind, make in (("ref", lambda ps: torch.optim.AdamW(ps, **HP, fused=True)),
                       ("foreach", lambda ps: torch.optim.AdamW(ps, **HP, foreach=True)),
                       ("wrong", lambda ps: _ScaledAdamW(ps, **HP, fused=True))):
        model = make_model().to(DEVICE)
        losses, skipped, _ = _loop(model, make(model.parameters()),
                                   _scaler(torch.amp.GradScaler), clip, n_micro, major)
        runs[kind] = (losses, _flat(model), skipped)
    (ref_l, ref_w, skipped), (fe_l, fe_w, fe_skipped), (wr_l, wr_w, _) = (
        runs["ref"], runs["foreach"], runs["wrong"])
    assert fe_skipped == skipped
    assert {s for s, k in enumerate(skipped) if k} == {s for s, _ in INF_STEPS}  # the premise
    loss_bounds = [torch.maximum(NOISE_MULTIPLE * (a - b).abs(), FLOOR * b.abs())
                   for a, b in zip(fe_l, ref_l)]
    w_bound = max(NOISE_MULTIPLE * float((fe_w - ref_w).norm()), FLOOR * float(ref_w.norm()))
    assert float((wr_w - ref_w).norm()) > w_bound  # the tolerance fails the wrong run
    assert any(bool(((a - b).abs() > bd).any()) for a, b, bd in zip(wr_l, ref_l, loss_bounds))
    return ref_l, ref_w, skipped, loss_bounds, w_bound


CASES = [("cpu-f1", BIG, None), ("cpu-f05-acc2", 0, "alternate"),
         ("cpu-f1-acc2-major", BIG, "alternate"), ("nvme-f05-acc2-major", BIG, "always")]


@pytest.mark.parametrize("name,budget,clip", CASES,
                         ids=[f"{c}-{b and 'big' or 'wait'}-{k or 'noclip'}"
                              for c, b, k in CASES])
def test_streamed_weights_under_a_cuda_scaler_are_within_adamws_noise(name, budget, clip,
                                                                      stores):
    tier, fraction, n_micro, major = CONFIGS[name]
    ref_l, ref_w, skipped, loss_bounds, w_bound = _reference(clip, n_micro, major)
    model = make_model().to(DEVICE)
    stream = stream_weights(model.blocks, store=stores(tier == "nvme"), tier=tier)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=CHUNK,
                     max_grad_norm=CLIPS[clip][0], grad_accumulation_steps=n_micro,
                     rollback_bytes=budget)
    try:
        losses, got_skipped, stats = _loop(model, opt, _scaler(StreamedGradScaler), clip,
                                           n_micro, major)
        weights = _flat(model)
    finally:
        opt.close()
        stream.close()
    assert got_skipped == skipped
    for step, (a, b, bound) in enumerate(zip(losses, ref_l, loss_bounds)):
        assert bool(((a - b).abs() <= bound).all()), (step, a, b, bound)
    distance = float((weights - ref_w).norm())
    assert distance <= w_bound, (distance, w_bound)
    spec = [s["speculated_chunks"] for s in stats]
    rolled = [s["rolled_back_chunks"] for s in stats]
    if budget:
        assert spec[0] == 0 and sum(spec) > 0, spec  # step 0 traces; later steps speculate
        for s in range(STEPS):
            if skipped[s]:
                assert rolled[s] == spec[s], (s, spec, rolled)
    else:
        assert sum(spec) == 0, spec


def test_torchs_cuda_scaler_over_streamed_weights_is_refused_then_a_streamed_one_trains(stores):
    """torch's GradScaler on CUDA over the host gradients: refused at its first step before
    anything is applied; the same optimizer then trains under a StreamedGradScaler within the
    reference's noise (the refused step changed no weight and left no ``grad_scale`` for the
    next scaler to multiply into its own: tests/stream/test_stream_grad_scaler.py's
    test_a_step_refused_under_a_scaler_leaves_no_scale_behind, bit for bit on the CPU)."""
    ref_l, ref_w, skipped, loss_bounds, w_bound = _reference(None, 1, False)
    model = make_model().to(DEVICE)
    stream = stream_weights(model.blocks, store=stores(False))
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=CHUNK,
                     rollback_bytes=BIG)
    before = _flat(model)
    try:
        scaler = _scaler(torch.amp.GradScaler)
        output = model.output
        model.output = lambda x, t=None: (lambda lo: (lo[0], scaler.scale(lo[1])))(output(x, t))
        forward_backward(model, [(i.to(DEVICE), t.to(DEVICE)) for i, t in batches(0, 1)])
        with pytest.raises(RuntimeError, match=r"scale is on cuda.*gradients on cpu.*"
                                               r"StreamedGradScaler"):
            scaler.step(opt)
        # its grad_scale left behind would be multiplied into the next scaler's
        # (Note [grad scaler]: step 1's loss was 1.2e-4 relative off before the refusal dropped it)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        opt.zero_grad(set_to_none=True)
        assert torch.equal(_flat(model), before)
        model.output = output
        losses, got_skipped, _ = _loop(model, opt, _scaler(StreamedGradScaler), None, 1, False)
        weights = _flat(model)
    finally:
        opt.close()
        stream.close()
    assert got_skipped == skipped
    for step, (a, b, bound) in enumerate(zip(losses, ref_l, loss_bounds)):
        assert bool(((a - b).abs() <= bound).all()), (step, a, b, bound)
    assert float((weights - ref_w).norm()) <= w_bound
