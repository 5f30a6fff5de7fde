"""CUDA: HybridAdam's worker steps a streamed weight's chunk only once that weight's gradient
has landed on the host (Note [streamed gradient hand-off] in tiermem/stream/grads.py).

The stream hands each gradient over at its take, with the event of its D2H copy still in
flight (Note [hand-off lag]); the worker waits on that event (``host_grads_landed`` in
tiermem/optim/chunk_worker.py) before it reads the pinned host gradient. To make a missing
wait give wrong numbers every step, the D2H stream sleeps ~50 ms (``torch.cuda._sleep``) after
each gradient is produced and before its copy: the hand-off reaches the worker long before the
bytes do. The reference is the same model, resident, with the same HybridAdam (every weight
offloaded, stepped by the same CPU kernel on the same gradients); params are compared by their
relative update error after 8 steps (1e-3, the bound of tests/optim/test_grad_copy_waits_cuda.py;
a gradient read before it landed is another step's or uninitialised memory: an error of order
1). The same comparison with the wait removed must fail: the tolerance is shown to fail.
"""

from __future__ import annotations

import pytest
import torch

from tiermem.optim import HybridAdam
from tiermem.optim.cpu_adam import native_available
from tiermem.stream import stream_weights
from tiermem.stream.copies import StreamCopies

from _cuda_nets import (BLOCKS, REL_TOL, STEPS, WIDTH, slow_grad_out, stream_store, twin_nets,
                        update_errors)

pytestmark = pytest.mark.cuda

CHUNKS = [WIDTH * WIDTH, WIDTH * WIDTH * 3 // 2]
"""chunk_numel: a chunk per weight, or chunks spanning two weights (each piece of a streamed
weight stepped in place all the same: Note [in-place host chunks])."""


def _optimizer(model, chunk_numel):
    return HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.1, offload_fraction=1.0,
                      chunk_numel=chunk_numel, placement="given")  # every chunk in backward


def _train(model, opt):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(STEPS):
        x = torch.randn(64, WIDTH, device="cuda", generator=gen)  # a new batch each step
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.synchronize()
    torch.cuda.synchronize()


def _check(monkeypatch, chunk_numel):
    ref, model, start = twin_nets()
    ref_opt = _optimizer(ref, chunk_numel)
    _train(ref, ref_opt)
    ref_opt.close()
    monkeypatch.setattr(StreamCopies, "grad_out", slow_grad_out(StreamCopies.grad_out))
    with stream_store() as store:
        stream = stream_weights(model.blocks, store=store, prefetch_blocks=1)
        opt = _optimizer(model, chunk_numel)
        try:
            _train(model, opt)
            st = opt.step_stats()
            stats = stream.stats()
        finally:
            opt.close()
            stream.close()
    assert st["chunks"] == -(-BLOCKS * WIDTH * WIDTH // chunk_numel)  # every chunk on the CPU
    if native_available():  # Note [in-place host chunks]: no streamed gradient in the ring
        assert st["in_place_bytes"] == BLOCKS * WIDTH * WIDTH * 4 and st["ring_copy_bytes"] == 0
    # every gradient was handed over at its take, none at the pass end (Note [hand-off lag])
    assert stats["handed_in_pass"] == BLOCKS * STEPS and stats["handed_at_end"] == 0
    for k, rel in enumerate(update_errors(model, ref, start)):
        assert rel < REL_TOL, f"block {k}: relative update error {rel:.2e}"


@pytest.mark.parametrize("chunk_numel", CHUNKS)
def test_cuda_worker_steps_a_streamed_chunk_only_after_its_gradient_landed(monkeypatch,
                                                                           chunk_numel):
    _check(monkeypatch, chunk_numel)


@pytest.mark.parametrize("chunk_numel", CHUNKS)
def test_cuda_the_comparison_fails_without_the_workers_wait(monkeypatch, chunk_numel):
    """The tolerance is shown to fail: the worker reads each host gradient at once. The
    stream's refill checksums (Note [streamed weight checksums]) are silenced here: they catch
    the same fault first (the next test), and this one is about the tolerance."""
    from tiermem.optim import chunk_worker
    from tiermem.stream.checksums import BufferChecks

    monkeypatch.setattr(chunk_worker, "host_grads_landed", lambda refs, block=True: True)
    monkeypatch.setattr(BufferChecks, "raise_changed", lambda self, wait=False: None)
    with pytest.raises(AssertionError, match="relative update error"):
        _check(monkeypatch, chunk_numel)


@pytest.mark.parametrize("chunk_numel", CHUNKS)
def test_cuda_a_step_before_the_gradient_landed_is_never_silent(monkeypatch, chunk_numel):
    """Without the worker's wait and with every guard on, training never ends silently wrong:
    either the refill checksum refuses a pass (a chunk stepped, and its weights' host copy
    written, while a block the pass still refills was in flight: both chunkings on the H200 in
    session 14, docs/results/cuda_final_s14.log) or the comparison sees the wrong update (the
    262144 chunking in session 15, docs/results/cuda_fixed_s15.log: the premature steps all
    landed outside any fill-to-refill window). Which guard fires is the fault's own timing: the
    fault is a race by construction, so the test asks for one of the two, never for neither."""
    from tiermem.optim import chunk_worker

    monkeypatch.setattr(chunk_worker, "host_grads_landed", lambda refs, block=True: True)
    with pytest.raises((RuntimeError, AssertionError),
                       match="filled with other values than earlier in the same|relative update"):
        _check(monkeypatch, chunk_numel)
