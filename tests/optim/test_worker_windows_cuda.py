"""CUDA twin of test_worker_windows.py: Note [unscaled before the hand-over] (amp_scaling.py) on
the GPU. A short accumulation window under ``torch.amp.GradScaler("cuda")``: ``take_scaler``
unscales every ``p.grad`` in place on the caller's stream, delayed there by
``torch.cuda._sleep`` (~50 ms on the H200), and ``step()`` then ships them all: no chunk may
be admitted to the speculative step (the old code admitted them and unscaled their copies a
second time), and the chunks shipped read the unscaled gradients after their own events,
recorded behind the unscale. A speculating optimizer must stay bit-identical at every step to a
waiting one (``rollback_bytes=0``) fed clones of its gradients, on the CPU kernel and on the
GPU lane (torch's fused Adam in both). And Note [reduced gradients untouched] (dist_modes.py):
ZeRO on one GPU (NCCL, one rank) refuses a gradient changed after backward filled its bucket,
the change delayed on the caller's stream the same way, and steps untouched gradients bit for
bit as ZeRO with ``overlap=False``.
"""

from __future__ import annotations

import pytest
import torch

from optim.test_speculate import assert_same_bits
from optim.test_worker_windows import (SHORT, STEPS, UnscaleWindow, train_short_windows,
                                       zero_refuses, zero_untouched)
from tiermem.optim import amp_scaling

SLEEP_CYCLES = 100_000_000  # ~50 ms of the caller's stream before the write (H200 clock)


@pytest.mark.cuda
@pytest.mark.parametrize("lane", [0.0, 1.0])
def test_cuda_chunks_shipped_after_the_in_place_unscale_read_it_once(monkeypatch, lane):
    window = UnscaleWindow(monkeypatch)
    unscale = amp_scaling._unscale

    def late_unscale(grads, scale, mode):
        torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream unscales ~50 ms from now
        return unscale(grads, scale, mode)

    monkeypatch.setattr(amp_scaling, "_unscale", late_unscale)
    a, opt_a, b, opt_b, speculated = train_short_windows("cuda", lane)
    torch.cuda.synchronize()
    assert [s for s, w in enumerate(window.in_place) if w] == sorted(SHORT), window.in_place
    assert all(speculated[s] > 0 for s in range(1, STEPS) if s not in SHORT), speculated
    assert window.late == [], window.late
    assert all(speculated[s] == 0 for s in SHORT), speculated
    assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
    opt_a.close(), opt_b.close()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["clip", "data", "scaler"])
def test_cuda_zero_refuses_a_gradient_changed_after_its_bucket_was_filled(kind, tmp_path):
    """Note [reduced gradients untouched] (dist_modes.py) on one GPU (NCCL, one rank): the
    change is queued ~50 ms behind the caller's stream, after the hooks copied the gradients
    into the buckets; step() must still see it (its comparison reads on that stream)."""
    zero_refuses("cuda", kind, tmp_path,
                 delay=lambda: torch.cuda._sleep(SLEEP_CYCLES))  # the change lands ~50 ms late


@pytest.mark.cuda
def test_cuda_zero_with_untouched_gradients_steps_as_without_overlap(tmp_path):
    zero_untouched("cuda", tmp_path)
