"""Note [streamed grad scaler]: HybridAdam stepping streamed weights (their host copies, Note
[streamed write-back]) under ``torch.amp.GradScaler``: the streamed gradients handed over in
backward wait for the scaler's verdict (``rollback_bytes=0``) or are stepped speculatively from
a ring copy unscaled on the worker and put back on a skipped step (the host copies rewritten
from the restored masters), as HybridAdam's own chunks are (Note [grad scaler overlap]).

The reference is independent: the same GPT built from the same seed, not streamed, trained by
torch's AdamW(fused=True) (bf16 weights: on fp32 masters) driven by its own GradScaler --
``scaler.scale(loss)`` backward through the same schedule, ``[scaler.unscale_(opt);
clip_grad_norm_]``, ``scaler.step(opt); scaler.update()``. Infs are injected by a tensor hook
into a streamed weight's gradient (step 3) and the LM head's (step 6): those steps are skipped
and the scale backs off; ``growth_interval=2`` grows it between them. Losses, weights, both
moments and step counts must be bit for bit the reference's after every one of 10 steps, for
the cpu and nvme stream tiers, depth-first and block-major, one and two micro-batches,
``offload_fraction`` 1 and 0.5, no clipping and clipping never / always / alternately, and the
speculated / rolled-back chunks of every step must be the decisions'. Before this, the second
``scaler.step`` was refused ("backward had already handed scaled gradients ... or streamed
weights"). Twins: no unscale on the worker, a scaled host gradient read in place, no rollback
on inf, and a clip by the norm taken of the scaled gradients must each go red.
"""

from __future__ import annotations

import time

import pytest
import torch

from optim.test_grad_scaler_overlap import MasterAdamW, _decisions
from tiermem.optim import amp_scaling, chunk_worker, speculate, streamed
from tiermem.optim.amp_scaling import StreamedGradScaler
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.optim.layout import chunk_state_bytes
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights

from _stream_train import batches, make_model

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 10
CHUNK = 2048
BIG = 1 << 30  # every chunk has a rollback slot
SMALL = 3 * chunk_state_bytes(CHUNK, torch.float32)  # three slots: the rest wait
INF_STEPS = ((3, "blocks.2.fc.weight"), (6, "head.weight"))  # step -> gradient made inf
# clip regime -> (max_grad_norm, loss factor per step)
CLIPS = {
    None: (None, lambda s: 1.0),
    "never": (1e6, lambda s: 1.0),
    "always": (1e-3, lambda s: 1.0),
    "alternate": (1.0, lambda s: 8.0 if s % 2 else 0.01),
}
# name -> (stream tier, offload_fraction, micro-batches, block-major)
CONFIGS = {
    "cpu-f1": ("cpu", 1.0, 1, False),
    "cpu-f05-acc2": ("cpu", 0.5, 2, False),
    "cpu-f1-acc2-major": ("cpu", 1.0, 2, True),
    "nvme-f1": ("nvme", 1.0, 1, False),
    "nvme-f05-acc2-major": ("nvme", 0.5, 2, True),
}


@pytest.fixture
def stores(make_stream_store):
    """``stores(nvme)``: a CPU store, no GPU budget, 8 MiB RAM; ``nvme``: a 64 MiB NVMe tier."""
    return lambda nvme: make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20,
                                          **({"nvme_bytes": 64 << 20} if nvme else {}))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _wait_worker(opt, limit_s=120.0) -> None:
    """Wait (bounded) until the worker has stepped every chunk it was given this step: each
    holds a rollback slot (Note [held chunks]), so the counts do not depend on the timing."""
    step = opt._step
    end = time.monotonic() + limit_s
    with step.idle:
        while step.outstanding and time.monotonic() < end:
            step.idle.wait(1.0)


def _loop(model, opt, scaler, clip, infs, n_micro, major, hybrid):
    """``STEPS`` steps; returns (per step: (losses, {name: bits}, state bits), per step: the
    scale before and after ``scaler.update()``, the reference's clip norms, HybridAdam's
    step_stats)."""
    max_norm, factor = CLIPS[clip]
    output = model.output
    cur = {"step": 0}

    def scaled_output(x, targets=None):
        logits, loss = output(x, targets)
        return logits, scaler.scale(loss * factor(cur["step"]))

    model.output = scaled_output
    named = dict(model.named_parameters())
    poison = {"on": None}
    for name in {n for _, n in infs}:
        named[name].register_hook(
            lambda g, n=name: g * float("inf") if poison["on"] == n else g)
    snaps, skipped, norms, stats = [], [], [], []
    for step in range(STEPS):
        cur["step"] = step
        poison["on"] = dict(infs).get(step)
        losses = forward_backward(model, batches(step, n_micro), block_major=major)
        if hybrid and opt._spec.active:
            _wait_worker(opt)  # every chunk that may speculate has: the counts are exact
        if max_norm is not None and not hybrid:  # the reference clips as torch's docs show
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append((scale, scaler.get_scale()))  # before and after the update
        opt.zero_grad(set_to_none=True)
        if hybrid:
            opt.synchronize()
            stats.append(opt.step_stats())
        snaps.append((torch.stack(losses), {k: _bits(v) for k, v in model.state_dict().items()},
                      _state(opt)))
    return snaps, skipped, norms, stats


def _state(opt) -> dict:
    """``{(param index, exp_avg / exp_avg_sq / step): bits}`` of AdamW, MasterAdamW (its fp32
    masters' state) or HybridAdam."""
    if isinstance(opt, MasterAdamW):
        inner = opt.inner
        return {(i, n): _bits(inner.state[m][n].float()) for i, m in enumerate(opt.masters)
                for n in ("exp_avg", "exp_avg_sq", "step") if m in inner.state}
    if isinstance(opt, HybridAdam):
        sd = opt.state_dict()["state"]
        return {(i, n): _bits(st[n].float()) for i, st in sd.items()
                for n in ("exp_avg", "exp_avg_sq", "step")}
    return {(i, n): _bits(opt.state[p][n].float()) for i, p in enumerate(opt.param_groups[0][
        "params"]) for n in ("exp_avg", "exp_avg_sq", "step") if p in opt.state}


def _scaler(dtype, cls=torch.amp.GradScaler):
    """A CPU GradScaler (``cls``); bf16: a scale of 3 * 2^k, whose reciprocal is inexact (the
    unscale's rounding to bf16 matters)."""
    init = 2.0 ** 12 if dtype == torch.float32 else 3.0 * 2 ** 8
    return cls("cpu", init_scale=init, growth_interval=2)


_REFERENCES: dict = {}


def _reference(dtype, clip, infs, n_micro, major):
    key = (dtype, clip, infs, n_micro, major)
    if key not in _REFERENCES:
        model = make_model(dtype)
        opt = (torch.optim.AdamW(model.parameters(), **HP, fused=True)
               if dtype == torch.float32 else MasterAdamW(model.parameters(), **HP))
        _REFERENCES[key] = _loop(model, opt, _scaler(dtype), clip, infs, n_micro, major, False)
    return _REFERENCES[key]


def _train(name, stores, budget, clip, infs=INF_STEPS, dtype=torch.float32, **extra):
    """Config ``name`` streamed and trained by HybridAdam under a GradScaler (``extra``'s
    ``scaler_cls``, else torch's)."""
    scaler_cls = extra.pop("scaler_cls", torch.amp.GradScaler)
    tier, fraction, n_micro, major = CONFIGS[name]
    model = make_model(dtype)
    stream = stream_weights(model.blocks, store=stores(tier == "nvme"), tier=tier)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=CHUNK,
                     max_grad_norm=CLIPS[clip][0], grad_accumulation_steps=n_micro,
                     rollback_bytes=budget, **extra)
    try:
        out = _loop(model, opt, _scaler(dtype, scaler_cls), clip, infs, n_micro, major, True)
        n_chunks = sum(opt.chunk_tiers().values())  # the lane's too: Note [lane unscale]
    finally:
        opt.close()
        stream.close()
    return out, n_chunks


def _differs(got, want) -> str | None:
    """Where ``got`` first differs from ``want`` (snapshots and skipped steps), or None."""
    if got[1] != want[1]:
        return f"skipped steps {got[1]} != {want[1]}"
    for step, ((la, wa, sa), (lb, wb, sb)) in enumerate(zip(got[0], want[0])):
        if not torch.equal(la, lb):
            return f"step {step}: losses {la.tolist()} != {lb.tolist()}"
        for k in wb:
            if not torch.equal(wa[k], wb[k]):
                return f"step {step}: weight {k} differs"
        if sa.keys() != sb.keys():
            return f"step {step}: state keys differ"
        for k in sb:
            if not torch.equal(sa[k], sb[k]):
                return f"step {step}: state {k} differs"
    return None


def _check(name, stores, budget, clip, infs=INF_STEPS, dtype=torch.float32,
           first_rolls_back=False, **extra):
    """Train config ``name`` (``extra``: more HybridAdam arguments) and compare with the
    reference step by step; asserts the speculation decisions (with
    ``first_rolls_back`` step 0 speculates on every chunk and rolls them back: no scaler was
    known yet). Returns the first difference (None: bit for bit)."""
    _, _, n_micro, major = CONFIGS[name]
    want = _reference(dtype, clip, infs, n_micro, major)
    (got, n_chunks) = _train(name, stores, budget, clip, infs, dtype, **extra)
    diff = _differs(got, want)
    if diff is None:
        skipped = [after < before for before, after in want[1]]
        assert {s for s, k in enumerate(skipped) if k} == {s for s, _ in infs}  # the premise
        assert infs == () or any(after > before for before, after in want[1])  # growth too
        slots = budget // chunk_state_bytes(CHUNK, torch.float32)
        decisions = _decisions(n_chunks, slots, skipped, want[2], CLIPS[clip][0])
        if first_rolls_back:
            decisions[0] = (n_chunks, n_chunks)
        counts = [(s["speculated_chunks"], s["rolled_back_chunks"]) for s in got[3]]
        assert counts == decisions, (counts, decisions)
        moved = [k for k in want[0][0][1] if k.startswith("blocks.")
                 and not torch.equal(want[0][0][1][k], want[0][-1][1][k])]
        assert moved, "the streamed weights moved"
    return diff


CASES = [(c, b, k) for c in CONFIGS for b in ("wait", "big") for k in (None, "alternate")]
BUDGETS = {"wait": 0, "small": SMALL, "big": BIG}


@pytest.mark.parametrize("name,budget,clip", CASES,
                         ids=[f"{c}-{b}-{k or 'noclip'}" for c, b, k in CASES])
def test_streamed_weights_under_a_scaler_are_adamw_with_its_scaler(name, budget, clip, stores,
                                                                   one_thread):
    """Chunks waiting for the verdict (``rollback_bytes=0``) or speculating, with and without
    clipping (alternating: the clipped steps roll back, the switch decides), infs injected."""
    assert _check(name, stores, BUDGETS[budget], clip) is None


@pytest.mark.parametrize("clip", ["never", "always"])
def test_clipping_never_and_always_under_a_scaler(clip, stores, one_thread):
    """The norm is that of the unscaled gradients (the norms taken at the streamed gradients'
    takes are of the scaled ones: dropped), never / always clipping."""
    assert _check("cpu-f05-acc2", stores, BIG, clip) is None
    assert _check("nvme-f1", stores, 0, clip) is None


@pytest.mark.parametrize("name", ["cpu-f1", "nvme-f05-acc2-major"])
def test_a_small_budget_speculates_some_chunks(name, stores, one_thread):
    """Three slots: the rest are held for the verdict (Note [held chunks])."""
    assert _check(name, stores, SMALL, "alternate") is None


@pytest.mark.parametrize("name", ["cpu-f1", "nvme-f1"])
def test_bf16_streamed_weights_unscale_with_torchs_rounding(name, stores, one_thread):
    """bf16 weights (fp32 masters), a scale of 3 * 2^k: the ring's copy of a streamed gradient
    is unscaled in bf16 as ``GradScaler.unscale_`` unscales ``p.grad``."""
    assert _check(name, stores, BIG, None, dtype=torch.bfloat16) is None
    assert _check(name, stores, 0, "alternate", dtype=torch.bfloat16) is None


def test_forward_sync_and_nvme_state_under_a_scaler(stores, make_stream_store, one_thread):
    """``param_sync="forward"`` (the next pass completes the step) and the optimizer's state
    on NVMe."""
    assert _check("cpu-f1", stores, BIG, "alternate", param_sync="forward") is None
    state_store = make_stream_store(gpu_bytes=0, cpu_bytes=8 << 20, nvme_bytes=64 << 20)
    assert _check("cpu-f05-acc2", stores, SMALL, None, state_tier="nvme",
                  store=state_store) is None


def test_the_first_steps_chunks_wait_for_the_scaler(stores, one_thread):
    """``placement="given"``: the first backward hands the streamed gradients over. Without
    clipping they wait for the first ``scaler.step`` (the scaler is learnt there); clipping
    with a budget, they speculate before any scaler is known, read no scale, and are rolled
    back and stepped again from the unscaled gradients."""
    assert _check("cpu-f1", stores, BIG, None, placement="given") is None
    assert _check("nvme-f1", stores, BIG, "alternate", placement="given",
                  first_rolls_back=True) is None


def test_no_overlap_and_the_gpu_lane_under_a_scaler(stores, one_thread):
    """``overlap=False`` (every gradient handed over in ``step()``, unscaled there) and the GPU
    lane (on the CPU here), whose chunks, streamed pieces included, speculate too and unscale
    their own copy (Note [lane unscale] in gpu_lane.py), within all slots or three."""
    assert _check("cpu-f1", stores, 0, "alternate", overlap=False) is None
    assert _check("cpu-f05-acc2", stores, BIG, "alternate", gpu_step_fraction=0.5) is None
    assert _check("cpu-f1", stores, SMALL, None, gpu_step_fraction=0.5) is None


def test_a_scaler_first_seen_after_free_steps_is_still_refused(stores, one_thread):
    """Without a scaler only the first step is held: a scaler appearing at the third step finds
    streamed chunks stepped from scaled gradients with no way back, and is refused."""
    model = make_model()
    stream = stream_weights(model.blocks, store=stores(False))
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=CHUNK,
                     rollback_bytes=BIG)
    try:
        for step in range(2):
            forward_backward(model, batches(step, 1))
            opt.step()
            opt.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        output = model.output
        model.output = lambda x, t=None: (lambda lo: (lo[0], scaler.scale(lo[1])))(output(x, t))
        forward_backward(model, batches(2, 1))
        with pytest.raises(RuntimeError, match=r"a scaler first seen after steps without one"):
            scaler.step(opt)
    finally:
        opt.close()
        stream.close()


def test_the_streamed_grad_scaler_on_the_cpu_is_torchs(stores, one_thread):
    """:class:`StreamedGradScaler` (for a CUDA scale over host gradients) where scale and
    gradients share the device: torch's own path, the same bits."""
    assert _check("cpu-f1", stores, BIG, "alternate", scaler_cls=StreamedGradScaler) is None
    assert _check("nvme-f05-acc2-major", stores, 0, None, scaler_cls=StreamedGradScaler) is None


def test_a_scale_on_another_device_than_the_gradients_is_refused(stores, one_thread):
    """Note [streamed grad scaler]: torch's scaler with its scale on another device than some
    gradients (on CUDA: the streamed weights' host gradients) races its own host copies; the
    step is refused before anything is applied (no GPU here: the scale's flag is put on the
    meta device by hand), and the optimizer trains on afterwards as AdamW + GradScaler."""
    want = _reference(torch.float32, None, (), 1, False)
    model = make_model()
    stream = stream_weights(model.blocks, store=stores(False))
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=CHUNK,
                     rollback_bytes=BIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        forward_backward(model, batches(0, 1))
        opt.grad_scale = torch.tensor(4.0)
        opt.found_inf = torch.zeros((), device="meta")
        with pytest.raises(RuntimeError, match=r"scale is on meta and gradients on cpu .*"
                                               r"use tiermem.optim.amp_scaling.StreamedGradSc"):
            opt.step()
        del opt.grad_scale, opt.found_inf
        opt.zero_grad(set_to_none=True)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"the refused step changed {k}"
        got = _loop(model, opt, _scaler(torch.float32), None, (), 1, False, True)
    finally:
        opt.close()
        stream.close()
    assert _differs(got, want) is None


def _refused_by_a_scaler(model, opt, scaler, why):
    """One backward under ``scaler`` whose ``scaler.step(opt)`` HybridAdam refuses, then
    ``zero_grad``. ``why``: ``"far"``, as it refuses torch's scaler on CUDA over host gradients
    (no GPU here: ``opt.found_inf`` is put on the meta device between torch's
    ``GradScaler.step`` and ``opt.step``, so that the scaler is on the call stack, registered,
    and its ``grad_scale`` set, as on CUDA); ``"lr"``: a NaN ``lr`` (refused before the scaler
    is taken: Note [finite hyper-parameters]), put right after."""
    output = model.output
    model.output = lambda x, t=None: (lambda lo: (lo[0], scaler.scale(lo[1])))(output(x, t))
    real_step, lr = opt.step, opt.param_groups[0]["lr"]

    def far_step(*args, **kwargs):
        opt.found_inf = torch.zeros((), device="meta")  # the scale on another device
        return real_step(*args, **kwargs)

    if why == "far":
        opt.step = far_step  # GradScaler.step calls optimizer.step: this, then HybridAdam's
        match = r"scale is on meta and gradients on cpu .*StreamedGradScaler"
    else:
        opt.param_groups[0]["lr"] = float("nan")
        match = r"'lr'\]=nan must be finite"
    try:
        forward_backward(model, batches(0, 1))
        with pytest.raises((RuntimeError, ValueError), match=match):
            scaler.step(opt)
    finally:
        vars(opt).pop("step", None)
        opt.param_groups[0]["lr"] = lr
        model.output = output
    opt.zero_grad(set_to_none=True)


def _refused_then_trained(stores, budget, why, **extra):
    """``cpu-f1`` with ``rollback_bytes=budget`` (``extra``: more HybridAdam arguments):
    refused once (:func:`_refused_by_a_scaler`, torch's scaler kept alive, as a caller's would
    be), then trained from step 0 by a fresh :class:`StreamedGradScaler`; returns ``_loop``'s
    result."""
    model = make_model()
    stream = stream_weights(model.blocks, store=stores(False))
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=CHUNK,
                     rollback_bytes=budget, **extra)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        scaler = _scaler(torch.float32)
        _refused_by_a_scaler(model, opt, scaler, why)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"the refused step changed {k}"
        return _loop(model, opt, _scaler(torch.float32, StreamedGradScaler), None, INF_STEPS,
                     1, False, True)
    finally:
        opt.close()
        stream.close()


REFUSALS = [("far", "wait", "trace"), ("far", "big", "trace"), ("lr", "big", "trace"),
            ("far", "big", "given")]


@pytest.mark.parametrize("why,budget,placement", REFUSALS,
                         ids=["-".join(r) for r in REFUSALS])
def test_a_step_refused_under_a_scaler_leaves_no_scale_behind(why, budget, placement, stores,
                                                              one_thread):
    """Note [grad scaler]: torch's ``GradScaler.step`` sets ``opt.grad_scale`` and deletes it
    only when ``step()`` returns, and the next ``GradScaler.step`` multiplies a ``grad_scale``
    it finds into its own scale. A step refused under a scaler (the far branch of Note
    [streamed grad scaler], as torch's CUDA scaler over host gradients is refused; a NaN lr)
    used to leave it behind: the next scaler's first step unscaled by the scale squared (on the
    H200 step 1's loss was 1.2e-4 relative off). Now a step that raises under a scaler drops
    it, and the same optimizer trains under a fresh scaler as a fresh optimizer does: bit for
    bit the reference, and the speculated / rolled back chunks of every step a fresh one's.
    ``placement="given"`` (state allocated at construction): the refused scaler used to stay
    registered, so the next step speculated under its scale where a fresh optimizer's first
    step holds its chunks for ``step()``."""
    want = _reference(torch.float32, None, INF_STEPS, 1, False)
    fresh, _ = _train("cpu-f1", stores, BUDGETS[budget], None, placement=placement)
    got = _refused_then_trained(stores, BUDGETS[budget], why, placement=placement)
    assert _differs(got, want) is None
    counts = [(s["speculated_chunks"], s["rolled_back_chunks"]) for s in got[3]]
    want_counts = [(s["speculated_chunks"], s["rolled_back_chunks"]) for s in fresh[3]]
    assert counts == want_counts
    if budget == "big":  # the counts can tell: step 0 holds, later steps speculate
        assert want_counts[0] == (0, 0) and all(n > 0 for n, _ in want_counts[1:]), want_counts


@pytest.mark.parametrize("why", ["far", "lr"])
def test_a_refused_steps_grad_scale_left_behind_is_caught(why, stores, monkeypatch, one_thread):
    """The twin: the old code path (nothing dropped when ``step()`` raises) leaves the refused
    step's ``grad_scale``, and the first trained step differs from the reference."""
    monkeypatch.setattr(amp_scaling, "drop_scaler_step", lambda opt: None)
    want = _reference(torch.float32, None, INF_STEPS, 1, False)
    assert _differs(_refused_then_trained(stores, BIG, why), want) is not None


# ---------------------------------------------------------------- must-fail twins


def test_a_worker_that_does_not_unscale_is_caught(stores, monkeypatch, one_thread):
    """The speculated chunks step the ring's scaled copy."""
    monkeypatch.setattr(amp_scaling, "unscale_copy_", lambda grads, scale: None)
    assert _check("cpu-f1", stores, BIG, None, infs=()) is not None


def test_a_scaled_host_gradient_read_in_place_is_caught(stores, monkeypatch, one_thread):
    """A speculated chunk reads its streamed pieces' host gradients in place (Note [in-place
    host chunks]): still scaled, since only the ring's copy is unscaled."""
    real = chunk_worker.in_place_grads
    monkeypatch.setattr(chunk_worker, "in_place_grads",
                        lambda group, chunk, refs, split_ok, scaled=False:
                        real(group, chunk, refs, split_ok))
    assert _check("cpu-f1", stores, BIG, None, infs=()) is not None


def test_a_skipped_step_without_rollback_is_caught(stores, monkeypatch, one_thread):
    """The skipped step leaves the speculated chunks (their NaN weights in the host copies)."""
    monkeypatch.setattr(speculate.Speculation, "undo", lambda self: 0)
    assert _check("cpu-f1", stores, BIG, None) is not None


def test_a_clip_by_the_scaled_norm_is_caught(stores, monkeypatch, one_thread):
    """The streamed gradients' norms taken at their takes (of the scaled gradients) are kept
    through the unscale and clip the first step."""
    monkeypatch.setattr(streamed.StreamedMode, "forget_norms", lambda self: None)
    assert _check("cpu-f1", stores, 0, "always") is not None
