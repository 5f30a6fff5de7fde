"""Note [streamed gradient norms] (tiermem/stream/grad_norms.py): with ``max_grad_norm``, a
streamed weight's gradient norm is taken where the whole gradient is (its take from the device)
and ``step()`` combines the recorded norms as ``torch.nn.utils.get_total_norm`` does. On the
CPU the global norm, and so every step, must be bit-identical to two independent references:
the same model trained by HybridAdam without streaming, and the streamed run on the path before
this change (``LocalMode.grads_and_norm``: torch's ``get_total_norm`` over every gradient in
``step()``, and the old ``clip_`` that multiplies host gradients by 1 too). 8 steps, weights
changing, in the regimes of tests/optim/test_speculate.py (never clipped, always, alternating,
inf and nan norms), one pass per step, depth-first accumulation (the last pass summed on the
device: precomputed, Note [last pass sums on the device]) and block-major accumulation
(precomputed), ``rollback_bytes`` 0 and 1 GiB; ``step_stats`` counts
the precomputed and computed norms. A norm that outlives its step, or one whose gradient was
changed after it was taken, goes red.
"""

from __future__ import annotations

import pytest
import torch

from optim.test_speculate import REGIMES
from test_stream_speculate import _scaled
from tiermem.optim import speculate
from tiermem.optim.hybrid_adam import HybridAdam
from tiermem.optim.modes import LocalMode
from tiermem.optim.streamed import StreamedMode
from tiermem.schedule.micro_batches import forward_backward
from tiermem.stream import stream_weights
from tiermem.stream.grad_norms import GradNorms, tensor_norm, total_norm

from _stream_train import batches, make_model

STEPS = 8
BUDGET = 1 << 30  # every chunk fits
COUNTS = ("norms_precomputed", "norms_computed")

# name -> (micro-batches, block-major, offload_fraction, dtype, rollback_bytes)
CONFIGS = {
    "one-pass": (1, False, 1.0, torch.float32, BUDGET),
    "one-pass-nospec": (1, False, 0.5, torch.float32, 0),
    "one-pass-bf16": (1, False, 1.0, torch.bfloat16, BUDGET),
    "acc2-major": (2, True, 0.5, torch.float32, BUDGET),
    "acc2-major-nospec": (2, True, 1.0, torch.float32, 0),
    "acc2-depth": (2, False, 1.0, torch.float32, BUDGET),
    "acc2-depth-nospec": (2, False, 0.5, torch.float32, 0),
}
PRECOMPUTED = set(CONFIGS)  # every streamed norm is taken on the "device" now


@pytest.fixture
def stores(make_stream_store):
    """``stores(device)``: a store with 8 MiB RAM (no GPU budget on the CPU, 1 MiB on CUDA)."""
    return lambda device="cpu": make_stream_store(
        device=device, gpu_bytes=0 if device == "cpu" else 1 << 20, cpu_bytes=8 << 20)


def _old_clip(grads, coef):
    """``speculate.clip_`` before Note [host clip by one]: every gradient times ``coef``."""
    by_device: dict = {}
    for t in grads:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        torch._foreach_mul_(ts, coef if device == coef.device else coef.to(device))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().reshape(-1).view(torch.int32)  # nan == nan, bit for bit


def _train(name, regime, stores, *, streamed=True, device="cpu", after_backward=None,
           after_step=None, reference=None, overlap=True):
    """8 steps of config ``name`` in ``regime``: ``(per step (losses, weights, state,
    step_stats counts), the global norm of every step() call, the references)``.
    ``after_backward(model, step)`` runs before ``step()``, ``after_step(model, opt, step)``
    after it (before ``zero_grad``); ``reference(grads)`` (given the gradients ``step()``
    clips) is recorded beside the norm."""
    n_micro, major, fraction, dtype, budget = CONFIGS[name]
    max_norm, scale_of = REGIMES[regime]
    model = make_model(dtype).to(device)
    scale = [1.0]
    _scaled(model, scale)
    stream = stream_weights(model.blocks, store=stores(device), tier="cpu") if streamed else None
    opt = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.1, offload_fraction=fraction,
                     chunk_numel=2048, max_grad_norm=max_norm, grad_accumulation_steps=n_micro,
                     rollback_bytes=budget, overlap=overlap)
    totals, refs = [], []
    grads_and_norm = opt._mode.grads_and_norm

    def recording(groups, dev):
        grads, total = grads_and_norm(groups, dev)
        totals.append(total.detach().clone())
        if reference is not None:
            refs.append(reference(grads))
        return grads, total

    opt._mode.grads_and_norm = recording
    out = []
    try:
        for step in range(STEPS):
            scale[0] = scale_of(step)
            mbs = [(i.to(device), t.to(device)) for i, t in batches(step, n_micro)]
            losses = torch.stack(forward_backward(model, mbs, block_major=major))
            if after_backward is not None:
                after_backward(model, step)
            opt.step()
            if after_step is not None:
                after_step(model, opt, step)
            opt.zero_grad(set_to_none=True)
            opt.synchronize()
            stats = opt.step_stats()
            sd = opt.state_dict()
            out.append((losses.cpu(), {k: v.detach().cpu().clone()
                                       for k, v in model.state_dict().items()},
                        {(i, k): t.cpu().clone() for i, st in sd["state"].items()
                         for k, t in st.items() if isinstance(t, torch.Tensor)},
                        tuple(stats.get(k) for k in COUNTS)))
    finally:
        opt.close()
        if stream is not None:
            stream.close()
    return out, [t.cpu() for t in totals], refs


def _same(got, want, what):
    (g, gt, _), (w, wt, _) = got, want
    assert len(g) == len(w) == STEPS and len(gt) == len(wt)
    for k, (a, b) in enumerate(zip(gt, wt)):
        assert torch.equal(_bits(a), _bits(b)), f"{what}: global norm {k}: {a} != {b}"
    for step, (a, b) in enumerate(zip(g, w)):
        assert torch.equal(_bits(a[0]), _bits(b[0])), f"{what} step {step}: losses differ"
        for kind, x, y in (("weight", a[1], b[1]), ("state", a[2], b[2])):
            assert x.keys() == y.keys()
            for k in y:
                assert torch.equal(_bits(x[k]), _bits(y[k])), f"{what} step {step}: {kind} {k}"


def _streamed_weights() -> int:
    return sum(1 for p in make_model().blocks.parameters() if p.requires_grad)


def _today(monkeypatch):
    """The path before Note [streamed gradient norms]: every norm in step(), host grads x 1."""
    monkeypatch.setattr(StreamedMode, "grads_and_norm", LocalMode.grads_and_norm)
    monkeypatch.setattr(speculate, "clip_", _old_clip)


CASES = ([("one-pass", r) for r in ("never", "always", "alternate", "nonfinite")]
         + [("one-pass-nospec", r) for r in ("never", "alternate", "nonfinite")]
         + [("one-pass-bf16", "alternate"), ("acc2-major", "alternate"),
            ("acc2-major", "nonfinite"), ("acc2-major-nospec", "always"),
            ("acc2-depth", "alternate"), ("acc2-depth-nospec", "nonfinite")])


@pytest.mark.parametrize("name,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_streamed_norms_are_bit_identical(name, regime, stores, monkeypatch, one_thread):
    got = _train(name, regime, stores)
    want = _train(name, regime, stores, streamed=False)
    with monkeypatch.context() as m:
        _today(m)
        today = _train(name, regime, stores)
    max_norm = REGIMES[regime][0]
    clipped = {s for s, n in enumerate(want[1]) if not float(n) <= max_norm - 1e-5}
    assert clipped == {"never": set(), "always": set(range(8)), "alternate": {1, 3, 5, 7},
                       "nonfinite": {2, 7}}[regime], want[1]  # the premise
    _same(got, want, f"{name}-{regime} vs unstreamed")
    _same(got, today, f"{name}-{regime} vs today's path")
    assert not torch.equal(want[0][0][1]["blocks.0.qkv.weight"],
                           want[0][-1][1]["blocks.0.qkv.weight"])  # the weights moved
    n = _streamed_weights()
    counts = [c for *_, c in got[0]]
    assert counts == [(n, 0) if name in PRECOMPUTED else (0, n)] * STEPS, counts
    assert all(c == (None, None) for *_, c in want[0])  # no streamed weights: no counts
    assert all(c == (None, None) for *_, c in today[0])  # LocalMode counts nothing


def test_a_norm_does_not_outlive_its_step(stores, monkeypatch, one_thread):
    """A second ``step()`` on the same gradients after a write no version counter sees (a
    ``.data`` write, like a GradScaler's unscale kernel): the norm recorded in the first step
    must not be used in the second, which clips the rescaled gradients (Note [streamed
    gradient norms]: records live for one step). Red when the clearing is removed."""
    def again(model, opt, step):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.mul_(1e4)  # moves no _version
        opt.step()

    def norms_held(model, opt, step):
        stream = next(iter(opt._mode._streams.values()))
        assert len(stream._grads.norms) == 0, "norms kept past their step"
        again(model, opt, step)

    want = _train("one-pass", "never", stores, streamed=False, after_step=again)
    got = _train("one-pass", "never", stores, after_step=norms_held)
    _same(got, want, "second step")
    assert all(float(t) > 1.0 for t in want[1][1::2]), want[1]  # the second steps clip
    monkeypatch.setattr(GradNorms, "clear", lambda self: None)
    with pytest.raises(AssertionError, match="norms kept past their step"):
        _train("one-pass", "never", stores, after_step=norms_held)
    stale = _train("one-pass", "never", stores, after_step=again)
    with pytest.raises(AssertionError, match="global norm 1"):
        _same(stale, want, "stale")


def test_a_gradient_changed_after_backward_is_measured_again(stores, monkeypatch, one_thread):
    """``rollback_bytes=0``: nothing is shipped during backward, so a gradient may be changed
    before ``step()`` (tracked: its ``_version`` moves); its recorded norm is refused and it
    is measured in ``step()``: bit-identical to the unstreamed loop, counted as computed. Red
    when the version is not checked."""
    def scale_one(model, step):
        if step in (2, 5):
            model.blocks[1].qkv.weight.grad.mul_(3.0)

    want = _train("one-pass-nospec", "alternate", stores, streamed=False,
                  after_backward=scale_one)
    got = _train("one-pass-nospec", "alternate", stores, after_backward=scale_one)
    _same(got, want, "changed gradient")
    n = _streamed_weights()
    assert [c for *_, c in got[0]] == [(n - 1, 1) if s in (2, 5) else (n, 0)
                                       for s in range(STEPS)]
    lookup = GradNorms.lookup
    monkeypatch.setattr(GradNorms, "lookup", lambda self, grad: (
        self._norms[grad][1] if grad in self._norms else lookup(self, grad)))
    blind = _train("one-pass-nospec", "alternate", stores, after_backward=scale_one)
    with pytest.raises(AssertionError, match="global norm 2"):
        _same(blind, want, "blind")


def test_gradients_set_by_the_user_are_measured_in_step(stores, one_thread):
    """Gradients the user sets between passes (no backward took them): no norm was recorded,
    each is measured in ``step()``; bit-identical to the unstreamed loop."""
    def user_grads(model, step):
        if step == 4:
            gen = torch.Generator().manual_seed(7)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)

    want = _train("one-pass", "alternate", stores, streamed=False, after_backward=user_grads)
    got = _train("one-pass", "alternate", stores, after_backward=user_grads)
    _same(got, want, "user gradients")
    n = _streamed_weights()
    assert [c for *_, c in got[0]][4] == (0, n)


def test_without_overlap_no_norm_is_taken(stores, monkeypatch, one_thread):
    """``overlap=False``: HybridAdam reads every gradient in ``step()``, so gradients may be
    changed after backward, also by a write no version counter sees (a GradScaler's unscale
    kernel): no norm is taken, each is measured in ``step()``; bit-identical to the unstreamed
    loop. Red when norms are taken without overlap."""
    def unscale(model, step):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        version = grads[0]._version
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1),
                                                         torch.tensor(0.25))
        assert grads[0]._version == version  # the premise: no version moved

    want = _train("one-pass", "alternate", stores, streamed=False, after_backward=unscale,
                  overlap=False)
    got = _train("one-pass", "alternate", stores, after_backward=unscale, overlap=False)
    _same(got, want, "no overlap")
    n = _streamed_weights()
    assert [c for *_, c in got[0]] == [(0, n)] * STEPS
    from tiermem.optim.streamed import Link
    monkeypatch.setattr(Link, "wants_norm", lambda self, passes: True)
    taken = _train("one-pass", "alternate", stores, after_backward=unscale, overlap=False)
    with pytest.raises(AssertionError, match="global norm 0"):
        _same(taken, want, "taken")


def test_total_norm_is_get_total_norm():
    """:func:`total_norm` with no records, and with records that are the tensors' own norms
    (any subset), is ``get_total_norm`` bit for bit over three dtypes: torch's group order,
    which the norms' order in the stack changes (the premise: the same norms stacked in the
    tensors' order give other bits); a record that is not the tensor's norm changes it."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    grads = [(torch.randn(int(torch.randint(1, 3000, (1,), generator=gen)), generator=gen)
              * float(torch.rand(1, generator=gen) * 3)).to(dtypes[k % 3]) for k in range(40)]
    want = torch.nn.utils.get_total_norm(grads, 2.0)
    own = [tensor_norm(g) for g in grads]
    assert not torch.equal(torch.linalg.vector_norm(torch.stack(own), 2.0), want)  # premise
    assert torch.equal(total_norm(grads, [None] * len(grads)), want)
    masks = [(1 << 40) - 1, 0x5555555555, 0xAAAAAAAAAA] + [
        int(torch.randint(0, 1 << 40, (1,), generator=gen)) for _ in range(8)]
    for mask in masks:
        norms = [n if mask >> k & 1 else None for k, n in enumerate(own)]
        assert torch.equal(total_norm(grads, norms), want), hex(mask)
    wrong = [None, own[1] * 2] + [None] * 38
    assert not torch.equal(total_norm(grads, wrong), want)
    assert torch.equal(total_norm([], []), torch.nn.utils.get_total_norm([]))
    with pytest.raises(ValueError, match="2 norms for 1 gradients"):
        total_norm(grads[:1], [None, None])
