"""The CUDA parity harness's checks can fail (tests/_parity_harness.py; Note [training parity] in
tests/test_cuda_training_parity.py): a row is compared with a reference whose first-step noise is
floored (``FIRST_STEP_NOISE_FLOOR``), so these CPU tests show that the floored first-step check
still goes red for a wrong gradient, and passes for a difference of the kernels' size."""

from __future__ import annotations

import pytest
import torch
from _parity_harness import NOISE_MULTIPLE, Run, assert_parity, summarise
from test_cuda_training_parity import FIRST_STEP_NOISE_FLOOR

FLOOR = FIRST_STEP_NOISE_FLOOR["bf16"]


def _runs(n: int = 3, numel: int = 4096) -> list[Run]:
    """``n`` identical reference runs (the no-offload loop on a deterministic machine): losses
    falling over 9 steps, params and first-step gradients of a realistic scale."""
    g = torch.Generator().manual_seed(0)
    losses = torch.linspace(10.5, 9.0, 9, dtype=torch.float64)
    params = torch.randn(numel, generator=g) * 0.02
    grads0 = torch.randn(numel, generator=g) * 1e-3
    base = [Run(losses.clone(), params.clone(), grads0.clone()) for _ in range(n)]
    # the runs' own noise in the losses and params (the floor only concerns the first step)
    base[1].losses[3] += 1e-4
    base[1].params[0] += 1e-3
    return base


def _got(ref_run: Run, grads0: torch.Tensor) -> Run:
    return Run(ref_run.losses.clone(), ref_run.params.clone(), grads0)


def test_a_first_step_within_the_floor_passes():
    """A first-step difference of one of the kernels' discrete results (4.96e-4, session 14's
    block_major_clip row) passes against references whose own samples all agreed."""
    runs = _runs()
    ref = summarise(runs, max(0.0, FLOOR))
    assert ref.grad_noise == FLOOR
    grads = runs[0].grads0.clone()
    grads[7] += 4.96e-4
    assert_parity(_got(runs[0], grads), ref, "kernel noise")


@pytest.mark.parametrize("error", [30.0, 1e-2, NOISE_MULTIPLE * FLOOR * 1.01])
def test_a_wrong_first_step_gradient_fails_the_floored_tolerance(error):
    """A stale or wrong tensor's first-step error (Note [reaped reload]: up to 30 in one element;
    1e-2; just over the floored tolerance) fails the check."""
    runs = _runs()
    ref = summarise(runs, FLOOR)
    grads = runs[0].grads0.clone()
    grads[11] += error
    with pytest.raises(AssertionError, match="first-step gradients differ"):
        assert_parity(_got(runs[0], grads), ref, "wrong gradient")


def test_the_floor_is_only_for_bf16():
    """fp32 runs do not take flash attention's atomics: their noise is sampled, not floored."""
    assert FIRST_STEP_NOISE_FLOOR["fp32"] == 0.0
    assert 0 < FLOOR < 1e-3
