"""A failed spill frees the step's saved activations at once (Note [stored errors] in
tiermem/store/transfer.py): with the garbage collector off, live keys return to the baseline
after a step whose spill writes or reads failed, and training goes on exactly."""

from __future__ import annotations

import errno
import gc
import warnings
from concurrent.futures import Future

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.offload import offload_activations

pytestmark = pytest.mark.usefixtures("one_thread")


def _failing_io(store, kind: str) -> list:
    """Make the spill backend's ``kind`` ("write"/"read") fail with EIO while ``flag[0]``."""
    backend = store._spill.backend
    name = "pwrite" if kind == "write" else "pread"
    real = getattr(backend, name)
    flag = [False]

    def call(handle, buf, offset):
        if flag[0]:
            failed: Future = Future()
            failed.set_exception(OSError(errno.EIO, "injected spill failure"))
            return failed
        return real(handle, buf, offset)

    setattr(backend, name, call)
    return flag


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_failed_spill_writes_free_the_step_at_once_and_train_exactly(make_store, no_gc):
    def train(offload: bool):
        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        store = make_store() if offload else None
        off = offload_activations(model.blocks, store=store, tier="nvme", num_layers=3) \
            if offload else None
        flag = _failing_io(store, "write") if offload else None
        live = []
        for step in range(8):
            if offload:
                flag[0] = step in (2, 3, 6)  # these steps' spills fail: the keys stay in RAM
                with off, warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # "spilling ... failed"
                    loss = model(*make_batch(step))[1]
                    loss.backward()
                    del loss
                live.append((off.live_keys, len(store)))
            else:
                model(*make_batch(step))[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()], live, off

    ref, _, _ = train(False)
    params, live, off = train(True)
    assert live == [(0, 0)] * 8  # old code: every key of a failed step stayed live until gc
    assert off.stats()["offloaded"] > 0
    for a, b in zip(ref, params):
        assert torch.equal(a, b)


def test_a_failed_spill_read_frees_the_step_when_the_error_is_dropped(make_store, no_gc):
    torch.manual_seed(0)
    model = TinyGPT()
    store = make_store()
    off = offload_activations(model.blocks, store=store, tier="nvme", num_layers=3)
    flag = _failing_io(store, "read")
    flag[0] = True
    with off:
        loss = model(*make_batch(1))[1]
        assert off.live_keys > 0
    with pytest.raises(OSError, match="injected spill failure"):
        loss.backward()
    del loss
    assert off.live_keys == 0 and len(store) == 0  # old code: all of them, until gc
    flag[0] = False
    with off:  # the offloader and the store go on
        model(*make_batch(2))[1].backward()
    assert off.live_keys == 0 and len(store) == 0
