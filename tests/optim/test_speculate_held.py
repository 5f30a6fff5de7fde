"""Note [held chunks] under the corners a run reaches: a budget smaller than the chunks (some
chunks held until ``step()`` decides) with every state tier, accumulation, the lane's device
and host slots and the clipping regimes of tests/optim/test_speculate.py; a refused step with
held chunks, retried or dropped; a checkpoint taken right after a rolled-back step and resumed
in a fresh optimizer. The reference is an independent HybridAdam with ``rollback_bytes=0``;
parameters, moments and step counts must be bit-identical after 8 steps.
"""

from __future__ import annotations

import time

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models, param_groups
from optim.test_speculate import REGIMES, STEPS, _config, assert_same_bits, refused_step
from tiermem.optim import HybridAdam
from tiermem.optim.layout import chunk_state_bytes

SMALL = 2 * chunk_state_bytes(1024, torch.float32) + 100  # two slots: most chunks are held


def _run(kw: dict, accum: int, regime: str) -> tuple:
    max_norm, scale = REGIMES[regime]
    model = make_models()
    opt = HybridAdam(param_groups(model), **kw, max_grad_norm=max_norm)
    held = 0
    for step in range(STEPS):
        for micro in range(accum):
            idx, tgt = make_batch(step * accum + micro)
            (model(idx, tgt)[1] * scale(step) / accum).backward()
        opt.step()
        held = max(held, len(opt._spec._held)) if opt._spec is not None else held
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    state = opt.state_dict()
    opt.close()
    return model, state


CASES = [(c, r) for c in ("cpu", "nvme", "split", "lane_half", "accumulation", "forward")
         for r in ("always", "alternate", "nonfinite")]


@pytest.mark.parametrize("config,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_a_small_budget_with_held_chunks_is_bit_identical(config, regime, tmp_path, one_thread):
    kw, accum = _config(config, tmp_path, "spec")
    got = _run(dict(kw, rollback_bytes=SMALL), accum, regime)
    ref_kw, _ = _config(config, tmp_path, "ref")
    want = _run(dict(ref_kw, rollback_bytes=0), accum, regime)
    assert_same_bits(*got, *want)
    for store in (kw.get("store"), ref_kw.get("store")):
        if store is not None:
            store.close()


@pytest.mark.parametrize("retry", [True, False])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_refused_step_with_held_chunks_leaves_the_optimizer_exact(tier, retry, tmp_path,
                                                                    one_thread):
    """step() refuses step 3 (a nan lr set after backward) while chunks are held; the user
    then either retries step() with the same gradients (lr fixed) or drops them; both runs do
    the same, so they must agree bit for bit."""
    runs = []
    for budget in (SMALL, 0):
        (tmp_path / str(budget)).mkdir()
        model = make_models()
        opt = HybridAdam(param_groups(model), **HP, chunk_numel=1024, offload_fraction=0.5,
                         state_tier=tier, nvme_dir=str(tmp_path / str(budget)),
                         max_grad_norm=1.0, rollback_bytes=budget)
        for step in range(STEPS):
            (model(*make_batch(step))[1] * (10.0 if step % 3 == 0 else 1e-2)).backward()
            if step == 3:
                refused_step(opt)
                if retry:
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        runs.append((model, opt.state_dict()))
        opt.close()
    assert_same_bits(*runs[0], *runs[1])


def _until_admitted(opt: HybridAdam) -> None:
    """Wait until the worker has admitted a chunk to the speculation, when it speculates: on a
    loaded 2-core machine step() sometimes came first and closed the admission with none, so
    nothing was rolled back at the clipped step and the count read 0 (a flaky test, not a
    wrong result)."""
    spec = opt._spec
    deadline = time.monotonic() + 60.0
    while spec.active and time.monotonic() < deadline:
        with opt._step.lock:
            if spec._admitted or spec._admitted_gpu:
                return
        time.sleep(0.001)  # the worker admits as the gradients land


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_checkpoint_right_after_a_rolled_back_step_resumes_exactly(tier, tmp_path, one_thread):
    """state_dict() straight after a clipped (rolled-back) step, no synchronize() first, loaded
    into a fresh optimizer on a copy of the model: training on from there matches the run that
    never speculated and never stopped."""
    max_norm, scale = REGIMES["alternate"]
    kw = dict(**HP, chunk_numel=1024, offload_fraction=0.5, state_tier=tier, max_grad_norm=max_norm)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "r").mkdir()
    model = make_models()
    opt = HybridAdam(param_groups(model), **kw, nvme_dir=str(tmp_path / "a"),
                     rollback_bytes=SMALL)
    for step in range(4):
        (model(*make_batch(step))[1] * scale(step)).backward()
        _until_admitted(opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert opt.step_stats()["rolled_back_chunks"] > 0  # step 3 clipped and rolled back
    saved = opt.state_dict()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt.close()
    resumed = make_models()
    resumed.load_state_dict(params)
    opt = HybridAdam(param_groups(resumed), **kw, nvme_dir=str(tmp_path / "b"),
                     rollback_bytes=SMALL)
    opt.load_state_dict(saved)
    for step in range(4, STEPS):
        (resumed(*make_batch(step))[1] * scale(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    got = (resumed, opt.state_dict())
    opt.close()
    _assert_as_never_speculating(got, scale, **kw, nvme_dir=str(tmp_path / "r"))


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_close_frees_the_rollback_slots(fraction, one_thread):
    """close() gives back the rollback copies (host RAM and the lane's device slots, Note
    [lane rollback on the GPU]) even while the caller still holds the optimizer (a trainer, a
    resumed run beside the closed one): on the old code every slot stayed allocated until the
    optimizer itself was dropped, so a GPU run holding the closed optimizer kept its device
    copies beside the new one's."""
    import weakref
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, chunk_numel=1024, offload_fraction=1.0,
                     gpu_step_fraction=fraction, placement="given", max_grad_norm=1.0,
                     rollback_bytes=1 << 30)
    for step in range(2):
        (model(*make_batch(step))[1] * 1e-2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    spec = opt._spec
    slots = spec._slots + spec._gpu_slots()
    assert slots and bool(spec._gpu_slots()) == (fraction > 0)
    refs = [weakref.ref(s) for s in slots]
    del slots
    opt.close()
    assert [r for r in refs if r() is not None] == []
    assert spec.held_bytes() == 0 and opt._lane.device_bytes() == 0
    opt.close()  # idempotent


@pytest.mark.parametrize("nth", [1, 4])
def test_a_failed_speculating_step_resumes_exactly_from_a_checkpoint(nth, monkeypatch, tmp_path,
                                                                     one_thread):
    """The CPU kernel raises on the ``nth`` chunk of a speculating, clipped step (2 slots:
    chunks admitted, others held): step() raises, the optimizer stays usable; the caller loads
    the checkpoint taken before that step (model and optimizer) into the same optimizer and
    trains on: bit-identical to the run that never failed nor speculated."""
    from tiermem.optim import chunk_worker
    kernel = chunk_worker.adam_step_unchecked
    calls = {"n": 0, "armed": False}

    def failing_kernel(*args, **kw):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == nth:
                calls["armed"] = False
                raise OSError("injected kernel failure")
        return kernel(*args, **kw)

    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", failing_kernel)
    max_norm, scale = REGIMES["alternate"]
    kw = dict(**HP, chunk_numel=1024, offload_fraction=0.5, max_grad_norm=max_norm)
    model = make_models()
    opt = HybridAdam(param_groups(model), **kw, rollback_bytes=SMALL)
    step, saved = 0, None
    failed = False
    while step < STEPS:
        if step == 3 and saved is None:
            opt.synchronize()
            saved = (opt.state_dict(),
                     {k: v.detach().clone() for k, v in model.state_dict().items()})
        (model(*make_batch(step))[1] * scale(step)).backward()
        calls["armed"] = step == 3 and not failed
        try:
            opt.step()
            opt.synchronize()
        except RuntimeError:
            failed = True
            opt.zero_grad(set_to_none=True)
            model.load_state_dict(saved[1])
            opt.load_state_dict(saved[0])
            continue  # step 3 again
        opt.zero_grad(set_to_none=True)
        step += 1
    assert failed
    opt.synchronize()
    got = (model, opt.state_dict())
    opt.close()
    _assert_as_never_speculating(got, scale, **kw)


def _assert_as_never_speculating(got, scale, **kw) -> None:
    """``got`` (model, state dict) bit-equal to an uninterrupted run of ``STEPS`` steps with
    HybridAdam(**kw, rollback_bytes=0), gradients scaled by ``scale(step)``."""
    ref = make_models()
    ref_opt = HybridAdam(param_groups(ref), **kw, rollback_bytes=0)
    for step in range(STEPS):
        (ref(*make_batch(step))[1] * scale(step)).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    ref_opt.synchronize()
    assert_same_bits(*got, ref, ref_opt.state_dict())
    ref_opt.close()
