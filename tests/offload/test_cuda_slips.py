"""CUDA-only slips of activation offload, each with a test that goes red when it comes back.

* A double-buffered set read without the compute stream waiting for its load's event: the
  loads are slowed with a long ``torch.cuda._sleep`` on the buffers' stream, so a reader that
  does not wait reads the set before its bytes land, every time. The test runs that slip itself
  (the wait taken out of :meth:`DoubleBuffer.view`) and requires wrong gradients from it.
* ``layers="auto"``'s default budget on CUDA counting the offloaded blocks' bytes as if they
  were on the device (:func:`tiermem.schedule.layers.kept_budget_bytes`): with no room left at
  the choice, only the last block's bytes may stay, so auto must offload every other block.
"""

from __future__ import annotations

import pytest
import torch

import tiermem.offload.activations as act
from models import TinyGPT, make_batch
from test_activations import _assert_clean, _assert_within_noise, _cuda_store, _grads, _run
from tiermem.offload import offload_activations
from tiermem.offload.double_buffer import DoubleBuffer

pytestmark = pytest.mark.cuda

_SLEEP_CYCLES = 50_000_000  # ~25 ms at 2 GHz per load: far longer than a block's backward


def _slow_loads(off) -> None:
    """Queue a long sleep on the buffers' stream before every double-buffer load."""
    buffers = off._buffers
    load = buffers.load

    def slow_load(records, store):
        buffers.stream.wait_stream(torch.cuda.current_stream())  # after what was queued
        with torch.cuda.stream(buffers.stream):
            torch.cuda._sleep(_SLEEP_CYCLES)
        return load(records, store)

    buffers.load = slow_load


def _view_without_wait(monkeypatch) -> None:
    """The slip: a reader that does not wait for the set's load event."""
    view = DoubleBuffer.view

    def no_wait(self, rec):
        events = [s.event for s in self.sets]
        for s in self.sets:
            s.event = None
        try:
            return view(self, rec)
        finally:
            for s, e in zip(self.sets, events):
                s.event = e

    monkeypatch.setattr(DoubleBuffer, "view", no_wait)


def test_cuda_double_buffer_reads_wait_for_the_load(tmp_path, monkeypatch):
    make = lambda: TinyGPT(vocab=512, d_model=256, n_heads=8, n_layers=6,  # noqa: E731
                           seq_len=256)

    def steps(model):  # two steps: the second loads into sets used before
        for seed in (31, 32):
            model(*make_batch(seed, batch=8, seq_len=256, vocab=512, device="cuda"))[1].backward()

    ref, _ = _run(make, steps, device="cuda")
    ref2, _ = _run(make, steps, device="cuda")  # the default kernels' run-to-run noise

    def run(slip: bool):
        spill = tmp_path / ("slip" if slip else "waits")
        spill.mkdir()
        store = _cuda_store(spill)

        def offload(m):
            off = offload_activations(m.blocks, store=store, layers=range(5),
                                      double_buffering=True)
            off.__enter__()
            off.__exit__(None, None, None)  # builds the double buffer
            _slow_loads(off)
            return off

        with monkeypatch.context() as patch:
            if slip:
                _view_without_wait(patch)
            model, off = _run(make, steps, device="cuda", offload=offload)
        torch.cuda.synchronize()  # test only: the slow loads and reaped moves settle
        stats = off.stats()
        assert stats["buffer_loads"] == 2 * 5 and stats["buffer_fallbacks"] == 0, stats
        _assert_clean(store, off)
        store.close()
        return _grads(model)

    slipped = run(slip=True)  # outside pytest.raises: only the comparison may go red
    with pytest.raises(AssertionError):  # the slip reads sets before their loads land
        _assert_within_noise(_grads(ref), _grads(ref2), slipped, ulps=1)
    _assert_within_noise(_grads(ref), _grads(ref2), run(slip=False), ulps=1)


def test_cuda_auto_budget_counts_only_the_kept_blocks(tmp_path, monkeypatch):
    """No room left at the choice (the device's total memory reads as the peak so far): the
    budget is the bytes the timed forward kept (the last block), so auto offloads all blocks
    but the last whatever the copies cost; counting the offloaded blocks too kept them all
    within budget and left the choice to the copy times (a few blocks)."""
    real_plan = act.ActivationOffloader._plan_layers
    real_props = torch.cuda.get_device_properties
    seen = {}

    class _NoRoom:
        def __init__(self, props, total):
            self._props, self.total_memory = props, total

        def __getattr__(self, name):
            return getattr(self._props, name)

    def plan(self):
        peak = torch.cuda.max_memory_allocated()
        seen["peak"] = peak
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda, "get_device_properties",
                          lambda device=None: _NoRoom(real_props(device), peak))
            real_plan(self)

    monkeypatch.setattr(act.ActivationOffloader, "_plan_layers", plan)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1024, d_model=1024, n_heads=16, n_layers=8, seq_len=1024).cuda()
    model = model.to(torch.bfloat16)
    store = _cuda_store(tmp_path, gpu_bytes="40GiB", cpu_bytes="48GiB", nvme_bytes=0)
    off = offload_activations(model.blocks, store=store)  # layers="auto", no max_kept_bytes
    with off:
        for seed in range(3):
            model(*make_batch(seed, batch=8, seq_len=1024, vocab=1024, device="cuda"))[1].backward()
    plan = off.plan
    print("auto plan with no room:", plan)
    assert "peak" in seen and all(n > 0 for n in plan["nbytes"])
    assert plan["max_kept_bytes"] == plan["nbytes"][7]  # only what the timed forward kept
    assert len(plan["layers"]) == 7 and plan["kept_bytes"] <= plan["max_kept_bytes"]
    torch.cuda.synchronize()
    _assert_clean(store, off)
    store.close()
