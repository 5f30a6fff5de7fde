"""CUDA twin of test_worker_windows.py: Note [unscaled before the hand-over] (amp_scaling.py) on
the GPU. A short accumulation window under ``torch.amp.GradScaler("cuda")``: ``take_scaler``
unscales every ``p.grad`` in place on the caller's stream, delayed there by
``torch.cuda._sleep`` (~50 ms on the H200), and ``step()`` then ships them all: no chunk may
be admitted to the speculative step (the old code admitted them and unscaled their copies a
second time), and the chunks shipped read the unscaled gradients after their own events,
recorded behind the unscale. A speculating optimizer must stay bit-identical at every step to a
waiting one (``rollback_bytes=0``) fed clones of its gradients, on the CPU kernel and on the
GPU lane (torch's fused Adam in both).
"""

from __future__ import annotations

import pytest
import torch

from optim.test_speculate import assert_same_bits
from optim.test_worker_windows import SHORT, STEPS, UnscaleWindow, train_short_windows
from tiermem.optim import amp_scaling

SLEEP_CYCLES = 100_000_000  # ~50 ms of the caller's stream before the unscale (H200 clock)


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
