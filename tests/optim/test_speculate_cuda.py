"""Note [lane rollback on the GPU] on a GPU: the lane's pre-step copies are device-to-device
copies on the lane stream, and a rollback loads the lane slot from them, not from the blob the
speculative write-back overwrote. Speculating runs must be bit-identical to the run that waits
for the norm (``rollback_bytes=0``): the same kernels on the same inputs, only the order of the
work differs. The premise -- two waiting runs are bit-identical (the backward is
deterministic here) -- is asserted first, so a difference is the speculation's.
"""

from __future__ import annotations

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models
from optim.test_speculate import STEPS, assert_same_bits
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda

SCALES = {"never": (1.0, lambda s: 1e-2), "always": (1e-3, lambda s: 1.0),
          "alternate": (1.0, lambda s: 10.0 if s % 2 else 1e-2)}


def _train(lane: float, regime: str, budget: int) -> tuple:
    max_norm, scale = SCALES[regime]
    model = make_models(device="cuda")
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     gpu_step_fraction=lane, max_grad_norm=max_norm, rollback_bytes=budget,
                     placement="given")
    counts = []
    for step in range(STEPS):
        (model(*make_batch(step, device="cuda"))[1] * scale(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        st = opt.step_stats()
        counts.append((st["speculated_chunks"], st["rolled_back_chunks"],
                       st["rollback_gpu_bytes"]))
    opt.synchronize()
    state = opt.state_dict()
    opt.close()
    torch.cuda.synchronize()
    return model, state, counts


@pytest.mark.parametrize("lane", [1.0, 0.5])
@pytest.mark.parametrize("regime", list(SCALES))
def test_lane_speculation_on_the_gpu_is_bit_identical(lane, regime):
    ref = _train(lane, regime, 0)
    again = _train(lane, regime, 0)
    assert_same_bits(ref[0], ref[1], again[0], again[1])  # the premise: deterministic runs
    model, state, counts = _train(lane, regime, 1 << 30)
    assert all(c[2] > 0 for c in counts), counts  # the lane's copies are on the GPU
    assert sum(c[0] for c in counts) > 0, counts
    if regime != "never":
        assert sum(c[1] for c in counts) > 0, counts  # rolled back at least once
    assert_same_bits(model, state, ref[0], ref[1])
