"""Threads: each thread trains its own model under its own ``offload_activations`` context
(saved-tensor hooks are per thread, and so is the active-context slot)."""

from __future__ import annotations

import threading

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.offload import offload_activations

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8


def _model(seed: int) -> TinyGPT:
    torch.manual_seed(seed)  # the global generator: made before the threads start
    return TinyGPT()


def _train(model: TinyGPT, seed: int, off_fn=None, barrier: threading.Barrier | None = None):
    """8 AdamW steps of ``model`` (batches differ every step), inside a fresh ``off_fn(model)``
    context when given; with ``barrier``, both threads are inside their contexts (forward done,
    backward not yet run) at the same time every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    off = off_fn(model) if off_fn is not None else None
    losses = []
    for step in range(STEPS):
        idx, targets = make_batch(100 * seed + step)
        if off is not None:
            with off:
                loss = model(idx, targets)[1]
                if barrier is not None:
                    barrier.wait()
        else:
            loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if off is not None:
        assert off.stats()["offloaded"] > 0 and off.live_keys == 0
    return losses, [p.detach().clone() for p in model.parameters()]


def test_two_threads_train_concurrently_each_bit_equal_to_its_own_run(make_store):
    refs = {seed: _train(_model(seed), seed) for seed in (1, 2)}
    models = {seed: _model(seed) for seed in (1, 2)}
    barrier = threading.Barrier(2)
    results, errors = {}, []
    tiers = {1: "cpu", 2: "nvme"}

    def work(seed):
        try:
            store = stores[seed]
            results[seed] = _train(models[seed], seed, lambda m: offload_activations(
                m.blocks, store=store, tier=tiers[seed], num_layers=3), barrier)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))
            barrier.abort()  # the other thread stops waiting

    stores = {seed: make_store() for seed in (1, 2)}
    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (1, 2):
        losses, params = results[seed]
        ref_losses, ref_params = refs[seed]
        assert losses == ref_losses and ref_losses[0] != ref_losses[-1]
        for a, b in zip(ref_params, params):
            assert torch.equal(a, b)
        assert len(stores[seed]) == 0


def test_one_context_entered_on_two_threads_is_refused(make_store):
    model = TinyGPT()
    off = offload_activations(model.blocks, store=make_store(), num_layers=2)
    errors = []

    def other():
        try:
            off.__enter__()
        except RuntimeError as exc:
            errors.append(str(exc))

    with off:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        model(*make_batch(1))[1].backward()  # still works on this thread
    assert len(errors) == 1 and "already entered on another thread" in errors[0]
    assert off.live_keys == 0
    with off:  # usable again
        model(*make_batch(2))[1].backward()


def test_another_threads_forward_of_the_same_blocks_is_not_this_contexts(make_store,
                                                                         monkeypatch):
    """The block hooks are the modules', so they run for any thread's forward; only the
    entering thread's forwards count (here: towards layers="auto"'s timed forward)."""
    import tiermem.offload.calibration as cal
    monkeypatch.setattr(cal, "copy_bandwidths", lambda device, nbytes: (1e15, 1e15))
    model = TinyGPT()
    off = offload_activations(model.blocks, store=make_store(gpu_bytes=8 << 20,
                                                             cpu_bytes=8 << 20))

    def other():
        for seed in range(3):
            model(*make_batch(seed))[1].backward()

    with off:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        for seed in range(2):
            model(*make_batch(10 + seed))[1].backward()
            assert off.plan is None  # the first two forwards of this context: no choice yet
        model(*make_batch(20))[1].backward()  # the third chooses (Note [offload rules], 8)
    assert off.plan is not None and off.live_keys == 0
