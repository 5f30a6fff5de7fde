"""The CUDA parity matrix's tolerance logic (Note [training parity]), checked on the CPU with
the noise shapes the H200 showed: step-1 loss noise, and discrete first-step gradient noise that
three references can miss while the first step sampled on its own (``first_step_noise``)
catches it."""

import pytest
import torch

import test_cuda_training_parity as parity


def _run(**changes) -> parity.Run:
    run = parity.Run(torch.full((9,), 10.0, dtype=torch.float64), torch.zeros(16), torch.zeros(16))
    for name, (index, value) in changes.items():
        getattr(run, name)[index] += value
    return run


@pytest.fixture
def reference():
    """Three references that agree on the first-step gradients, and a sampled first step whose
    distinct results lie 2.9e-4 apart (as on the H200)."""
    samples = iter([torch.zeros(16), torch.zeros(16), _run(grads0=(2, 2.9e-4)).grads0] * 4)
    noise = parity.first_step_noise(lambda: next(samples))
    assert noise == pytest.approx(2.9e-4)
    return parity.summarise([_run(), _run(losses=(5, 5e-5), params=(0, 0.3)), _run()], noise)


def test_noise_seen_at_any_step_and_in_the_sampled_first_step_is_tolerated(reference):
    row = _run(losses=(1, 6e-5), params=(1, 0.5), grads0=(1, 2.9e-4))
    parity.assert_parity(row, reference, "row")


def test_without_the_sampled_first_step_its_noise_would_fail_a_correct_row():
    ref = parity.summarise([_run(), _run(losses=(5, 5e-5), params=(0, 0.3)), _run()])
    with pytest.raises(AssertionError, match="first-step gradients"):
        parity.assert_parity(_run(grads0=(1, 2.9e-4)), ref, "row")


@pytest.mark.parametrize("changes", [dict(losses=(4, 5e-4)), dict(params=(3, 2.0)),
                                     dict(grads0=(5, 5e-3))])
def test_a_difference_beyond_the_noise_fails(reference, changes):
    with pytest.raises(AssertionError):
        parity.assert_parity(_run(**changes), reference, "bad")
