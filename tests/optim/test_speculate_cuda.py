"""Note [lane rollback on the GPU] on a GPU: the lane's pre-step copies are device-to-device
copies on the lane stream, and a rollback loads the lane slot from them, not from the blob the
speculative write-back overwrote. A speculating optimizer (A: real backward, its hooks ship
gradients as they land) and a waiting one (B: ``rollback_bytes=0``, handed clones of A's
gradients, so the backward's own run-to-run noise cannot enter) must keep bit-identical
parameters at every step and the same state at the end: the same kernels on the same inputs,
only the order of the work differs.
"""

from __future__ import annotations

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, make_models
from optim.test_speculate import STEPS, _bits, assert_same_bits
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda

SCALES = {"never": (1.0, lambda s: 1e-2), "always": (1e-3, lambda s: 1.0),
          "alternate": (1.0, lambda s: 10.0 if s % 2 else 1e-2)}


def _opt(model, lane: float, max_norm: float, budget: int) -> HybridAdam:
    return HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                      gpu_step_fraction=lane, max_grad_norm=max_norm, rollback_bytes=budget,
                      placement="given")


@pytest.mark.parametrize("lane", [1.0, 0.5])
@pytest.mark.parametrize("regime", list(SCALES))
def test_lane_speculation_on_the_gpu_is_bit_identical(lane, regime):
    max_norm, scale = SCALES[regime]
    a, b = make_models(device="cuda"), make_models(device="cuda")
    opt_a, opt_b = _opt(a, lane, max_norm, 1 << 30), _opt(b, lane, max_norm, 0)
    counts = []
    for step in range(STEPS):
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(_bits(pa), _bits(pb)), (step, name)
        (a(*make_batch(step, device="cuda"))[1] * scale(step)).backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.detach().clone()  # before A's step() clips A's in place
        opt_a.step()
        opt_b.step()
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=True)
        st = opt_a.step_stats()
        counts.append((st["speculated_chunks"], st["rolled_back_chunks"],
                       st["rollback_gpu_bytes"]))
    torch.cuda.synchronize()
    assert all(c[2] > 0 for c in counts), counts  # the lane's copies are on the GPU
    assert sum(c[0] for c in counts) > 0, counts
    if regime != "never":
        assert sum(c[1] for c in counts) > 0, counts  # rolled back at least once
    assert_same_bits(a, opt_a.state_dict(), b, opt_b.state_dict())
    opt_a.close(), opt_b.close()
