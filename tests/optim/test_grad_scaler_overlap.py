"""Note [grad scaler overlap]: HybridAdam with ``overlap=True`` under ``torch.amp.GradScaler``
steps offloaded chunks during backward (within ``rollback_bytes``), unscaling each chunk's
gradient copy as ``GradScaler.unscale_`` does, and puts them back when the scaler finds an
inf/NaN gradient (the step is skipped) or when the clip coefficient is not 1.

The reference is independent: torch's AdamW(fused=True) driven by its own GradScaler on a copy
of the model -- ``scaler.scale(loss).backward(); [scaler.unscale_(opt); clip_grad_norm_];
scaler.step(opt); scaler.update()``. fp32 params: autocast fp16 forward. bf16 params: AdamW on
fp32 masters (:class:`MasterAdamW`), the gradient unscaled by the scaler in bf16 then widened,
the params the masters rounded; its scale is 3 * 2^k, so ``1 / scale`` is inexact and the
unscale's rounding to bf16 matters. Infs are injected by a tensor hook into one gradient on
chosen steps (the LM head's, the first to land, or the embedding's, the last), so those steps
are skipped and the scale backs off. Parameters, both moments and step counts must be bit for
bit the reference's over 10 steps; the speculated / rolled-back chunks of every step must be
the decisions' (a model of Note [speculation switch] fed with the reference's norms).
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam, amp_scaling, chunk_worker, speculate
from tiermem.optim.layout import chunk_state_bytes
from tiermem.optim.speculate import SpeculationSwitch

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 10
BIG = 1 << 30  # every chunk has a rollback slot
SMALL = 3 * chunk_state_bytes(1024, torch.float32)  # three slots: the rest wait
INF_STEPS = {3: "head", 6: "tok"}  # step -> the parameter whose gradient turns inf
# clip regime -> (max_grad_norm, loss factor per step)
CLIPS = {
    None: (None, lambda s: 1.0),
    "never": (1e6, lambda s: 1.0),
    "always": (1e-3, lambda s: 1.0),
    "alternate": (1.0, lambda s: 8.0 if s % 2 else 0.01),
}


class MasterAdamW(torch.optim.Optimizer):
    """AdamW(fused=True) on fp32 masters of bf16 params: the gradients (as the scaler left
    them) widened to fp32, the params the updated masters rounded to bf16."""

    def __init__(self, params, **hp):
        params = list(params)
        super().__init__(params, {})
        self.masters = [p.detach().float() for p in params]  # independent fp32 copies
        self.inner = torch.optim.AdamW(self.masters, **hp, fused=True)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.param_groups[0]["params"], self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.param_groups[0]["params"], self.masters):
            p.copy_(m)


def _model(dtype):
    torch.manual_seed(0)
    return TinyGPT().to(dtype)


def _loop(model, opt, dtype, clip_regime, infs, hybrid=False, accum=1):
    """``STEPS`` steps of ``accum`` micro-batches under a GradScaler; returns (skipped,
    unscaled norms or None, stats)."""
    max_norm, factor = CLIPS[clip_regime]
    init = 2.0 ** 12 if dtype == torch.float32 else 3.0 * 2 ** 8
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=2)
    named = dict(model.named_parameters())
    poison = {"on": None}
    for name in ("head.weight", "tok.weight"):
        named[name].register_hook(
            lambda g, n=name: g * float("inf") if poison["on"] == n.split(".")[0] else g)
    skipped, norms, stats = [], [], []
    for step in range(STEPS):
        for micro in range(accum):
            poison["on"] = infs.get(step) if micro == accum - 1 else None
            idx, tgt = make_batch(step * accum + micro)
            with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float32):
                _, loss = model(idx, tgt)
            scaler.scale(loss * factor(step) / accum).backward()
        if hybrid and opt._spec.active:
            _admitted_done(opt)  # every chunk that may speculate has: the counts are exact
        if max_norm is not None and not hybrid:  # the reference clips as torch's docs show
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if hybrid and step:  # the last step's (param_sync="forward": complete by now)
            stats.append(opt.step_stats())
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        opt.zero_grad(set_to_none=True)
    if hybrid:
        opt.synchronize()
        stats.append(opt.step_stats())
    return skipped, norms, stats


def _admitted_done(opt, limit_s=120.0):
    """Wait (bounded) until the worker has stepped every chunk it was given: each holds a
    rollback slot (Note [held chunks]), so all of them are admitted."""
    step = opt._step
    end = time.monotonic() + limit_s
    with step.idle:
        while step.outstanding and time.monotonic() < end:
            step.idle.wait(1.0)


def _bits(t):
    t = t.detach().reshape(-1)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@functools.lru_cache(maxsize=None)
def _reference(dtype, clip_regime, inf_key, accum=1):
    """The reference run: (params, [(exp_avg, exp_avg_sq, step)] per param, skipped, norms)."""
    model = _model(dtype)
    if dtype == torch.float32:
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    else:
        opt = MasterAdamW(model.parameters(), **HP)
    skipped, norms, _ = _loop(model, opt, dtype, clip_regime, dict(inf_key), accum=accum)
    inner = opt if dtype == torch.float32 else opt.inner
    keys = list(model.parameters()) if dtype == torch.float32 else opt.masters
    state = [tuple(inner.state[k][n].clone() for n in ("exp_avg", "exp_avg_sq", "step"))
             for k in keys]
    return [p.detach().clone() for p in model.parameters()], state, skipped, norms


def _decisions(n_chunks, slots, skipped, norms, max_norm):
    """The (speculated, rolled back) chunks of every step: step 0 only traces (Note [trace
    placement]) and registers the scaler; a step speculates on min(slots, chunks) chunks when
    the switch is on (clipping only); all of them roll back on a skipped step or a clipped
    one (Note [speculation switch]: every step the scaler did not skip is recorded)."""
    switch = SpeculationSwitch()
    out = []
    for s in range(STEPS):
        on = s >= 1 and slots > 0 and switch.on()
        n = min(slots, n_chunks) if on else 0
        clipped = max_norm is not None and bool(
            torch.clamp(max_norm / (norms[s] + 1e-6), max=1.0) != 1.0)
        out.append((n, n if skipped[s] or clipped else 0))
        if max_norm is not None and not skipped[s]:
            switch.record(clipped)
    return out


def _check(dtype, fraction, budget, clip_regime, infs, tmp_path=None, expect_red=False,
           **extra):
    """Train HybridAdam (``extra``: more of its arguments) and compare with the reference;
    returns whether it matched (asserting when ``expect_red`` is False)."""
    accum = extra.get("grad_accumulation_steps", 1)
    params, state, skipped, norms = _reference(dtype, clip_regime, tuple(sorted(infs.items())),
                                               accum)
    max_norm = CLIPS[clip_regime][0]
    model = _model(dtype)
    kw = dict(state_tier="nvme", nvme_dir=str(tmp_path)) if tmp_path is not None else {}
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=1024,
                     rollback_bytes=budget, max_grad_norm=max_norm, **kw, **extra)
    got_skipped, _, stats = _loop(model, opt, dtype, clip_regime, infs, hybrid=True,
                                  accum=accum)
    sd = opt.state_dict()
    # the GPU lane's chunks are admitted too (Note [lane unscale] in gpu_lane.py)
    n_chunks = sum(opt.chunk_tiers().values())
    opt.close()
    same = got_skipped == skipped
    same = same and all(torch.equal(_bits(p), _bits(q)) for p, q in zip(model.parameters(),
                                                                         params))
    for i, (m, v, n) in enumerate(state):
        st = sd["state"][i]
        same = same and torch.equal(_bits(st["exp_avg"].float()), _bits(m.float()))
        same = same and torch.equal(_bits(st["exp_avg_sq"].float()), _bits(v.float()))
        same = same and float(st["step"]) == float(n)
    if expect_red:
        return same
    assert got_skipped == skipped
    assert {s for s, k in enumerate(skipped) if k} >= set(infs)  # the injected steps skip
    for (name, p), q in zip(model.named_parameters(), params):
        assert torch.equal(_bits(p), _bits(q)), name
    assert same  # moments and step counts
    slots = budget // chunk_state_bytes(1024, torch.float32)
    want = _decisions(n_chunks, slots, skipped, norms, max_norm)
    got = [(s["speculated_chunks"], s["rolled_back_chunks"]) for s in stats]
    assert got == want, (got, want)
    return same


@pytest.mark.parametrize("infs", [{}, INF_STEPS], ids=["finite", "inf"])
@pytest.mark.parametrize("budget", [0, SMALL, BIG], ids=["wait", "small", "big"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_overlap_under_a_scaler_is_adamw_with_its_scaler_bit_for_bit(fraction, budget, infs,
                                                                    one_thread):
    """(a) no infs, (b) infs injected (skipped steps, the scale backing off), fp32 params under
    fp16 autocast, offload 1 and 0.5, the budget 0 (every chunk waits for the verdict), three
    slots and all. Before: the second step was refused ("backward had already handed scaled
    gradients to the CPU step")."""
    _check(torch.float32, fraction, budget, None, infs)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_bf16_params_unscale_with_torchs_rounding(fraction, one_thread):
    """bf16 params, a scale of 3 * 2^k: the chunk's gradient copy is unscaled in bf16 as
    ``GradScaler.unscale_`` unscales ``p.grad``, before the kernel widens it."""
    _check(torch.bfloat16, fraction, BIG, None, INF_STEPS)


@pytest.mark.parametrize("clip_regime", ["never", "always", "alternate"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_clipping_under_a_scaler_speculates_exactly(clip_regime, fraction, one_thread):
    """(c) ``max_grad_norm`` with the scaler, the norm that of the unscaled gradients, as
    torch's clip after ``scaler.unscale_``: never / always / alternately clipping, with an inf
    step; the clipped steps roll back and the switch decides which steps speculate."""
    _check(torch.float32, fraction, BIG, clip_regime, INF_STEPS)


@pytest.mark.parametrize("extra", [dict(param_sync="forward"), dict(grad_accumulation_steps=2),
                                   dict(gpu_step_fraction=0.5)],
                         ids=["forward", "accumulation", "lane"])
def test_forward_sync_accumulation_and_the_lane_under_a_scaler(extra, one_thread):
    """``param_sync="forward"``, two micro-batches per step, and the GPU lane (on the CPU
    here), whose chunks speculate too (tests/optim/test_lane_grad_scaler.py), with clipping
    alternating and injected infs."""
    _check(torch.float32, 1.0, BIG, "alternate", INF_STEPS, **extra)


def test_clipping_under_a_scaler_with_no_budget_waits(one_thread):
    _check(torch.float32, 1.0, 0, "alternate", INF_STEPS)


def test_nvme_state_under_a_scaler(tmp_path, one_thread):
    _check(torch.float32, 1.0, SMALL, None, INF_STEPS, tmp_path=tmp_path)


def test_a_kernel_that_does_not_unscale_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the worker steps the scaled gradient copy."""
    monkeypatch.setattr(amp_scaling, "unscale_copy_", lambda grads, scale: None)
    assert not _check(torch.float32, 1.0, BIG, None, {}, expect_red=True)


def test_an_unscale_without_the_rounding_to_bf16_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the kernel reads ``grad * (1 / scale)`` in fp32 (as an unscale inside
    the kernel, without rounding the product to the gradient's dtype, would)."""
    pending = {}

    def mark(grads, scale):
        inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        for g in grads:
            pending[g.data_ptr()] = inv

    real = chunk_worker.adam_step_unchecked

    def kernel(param, grad, *args, **kw):
        inv = pending.pop(grad.data_ptr(), None)
        return real(param, grad if inv is None else grad.float() * inv, *args, **kw)

    monkeypatch.setattr(amp_scaling, "unscale_copy_", mark)
    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", kernel)
    assert not _check(torch.bfloat16, 1.0, BIG, None, {}, expect_red=True)


def test_a_step_that_does_not_roll_back_on_inf_is_caught(monkeypatch, one_thread):
    """Must-fail twin: the skipped step leaves the speculative chunks stepped."""
    monkeypatch.setattr(speculate.Speculation, "undo", lambda self: 0)
    assert not _check(torch.float32, 1.0, BIG, None, INF_STEPS, expect_red=True)


def test_a_scaler_first_seen_after_free_steps_is_refused(one_thread):
    """Without a scaler the first step is held (Note [grad scaler overlap]); later steps step
    chunks during backward freely, so a scaler appearing then is refused, naming the fixes."""
    model = _model(torch.float32)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     placement="given", rollback_bytes=BIG)
    for step in range(3):
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    idx, tgt = make_batch(3)
    scaler.scale(model(idx, tgt)[1]).backward()
    with pytest.raises(RuntimeError, match=r"a scaler first seen after steps without one"):
        scaler.step(opt)
    opt.close()


def test_a_new_scaler_after_the_first_was_dropped(one_thread):
    """A scaler dropped after 4 steps and a new one (another scale) for 4 more, as a resumed
    run makes: the chunks keep waiting or speculating once a scaler has been seen; the first
    step of the new one speculated with no scale to unscale by (the old scaler is gone), so
    it is rolled back, and the new scaler is registered; bit for bit AdamW + its scalers."""
    import gc
    ref, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     rollback_bytes=BIG)
    rolled = []
    for m, o in ((ref, ref_opt), (model, opt)):
        for init, steps in ((2.0 ** 10, range(4)), (2.0 ** 6, range(4, 8))):
            scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=3)
            for step in steps:
                idx, tgt = make_batch(step)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = m(idx, tgt)[1]
                scaler.scale(loss).backward()
                if o is opt and opt._spec.active:
                    _admitted_done(opt)
                scaler.step(o)
                scaler.update()
                if o is opt:
                    rolled.append(opt.step_stats()["rolled_back_chunks"])
                o.zero_grad(set_to_none=True)
            del scaler
            gc.collect()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    n_chunks = sum(opt.chunk_tiers().values())
    assert rolled == [0, 0, 0, 0, n_chunks, 0, 0, 0]
    opt.close()


def plain_steps_after_a_scaler(**kw):
    """Three steps under a GradScaler, then five plain ``opt.step()`` calls, for AdamW and for a
    speculating HybridAdam (``kw``: more of its arguments); returns ``(model, ref, opt, rolled
    back chunks of each plain step)``."""
    ref, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     rollback_bytes=BIG, **kw)
    rolled = []
    for m, o in ((ref, ref_opt), (model, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for step in range(8):
            idx, tgt = make_batch(step)
            if step < 3:
                scaler.scale(m(idx, tgt)[1]).backward()
                scaler.step(o)
                scaler.update()
            else:
                m(idx, tgt)[1].backward()
                if o is opt and opt._spec.active:
                    _admitted_done(opt)
                o.step()
                if o is opt:
                    rolled.append(opt.step_stats()["rolled_back_chunks"])
            o.zero_grad(set_to_none=True)
    return model, ref, opt, rolled


def test_a_plain_step_after_a_scaler_rolls_the_unscaled_chunks_back(one_thread):
    """A registered scaler, then plain ``opt.step()`` calls: the chunks stepped during backward
    unscaled their gradients by the scaler's scale, which this step was not given: they are
    rolled back and stepped again from the gradients as they are, as AdamW steps them."""
    model, ref, opt, rolled = plain_steps_after_a_scaler()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    n_chunks = sum(opt.chunk_tiers().values())
    assert rolled == [n_chunks] * 5
    opt.close()
