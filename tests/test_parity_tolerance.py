"""The CUDA parity matrix's tolerance logic (Note [training parity]), checked on the CPU with
the noise shapes the H200 showed: discrete first-step gradient noise and step-1 loss noise."""

import pytest
import torch

import test_cuda_training_parity as parity


def _run(**changes) -> parity.Run:
    run = parity.Run(torch.full((9,), 10.0, dtype=torch.float64), torch.zeros(16), torch.zeros(16))
    for name, (index, value) in changes.items():
        getattr(run, name)[index] += value
    return run


@pytest.fixture
def references(monkeypatch):
    refs = {("adamw", "bf16", False, ""): (_run(), _run(losses=(5, 5e-5), params=(0, 0.3)),
                                           _run(grads0=(0, 3e-8))),
            ("hybrid", "bf16", False, ""): (_run(grads0=(2, 2.9e-4)),) * 3}
    monkeypatch.setattr(parity, "_REFERENCES", refs)
    return refs


def test_noise_seen_at_any_step_and_in_any_optimizers_first_step_is_tolerated(references):
    ref = references[("adamw", "bf16", False, "")]
    row = _run(losses=(1, 6e-5), params=(1, 0.5), grads0=(1, 2.9e-4))
    parity.assert_parity(row, ref, "row", key=("adamw", "bf16", False, ""))


@pytest.mark.parametrize("changes", [dict(losses=(4, 5e-4)), dict(params=(3, 2.0)),
                                     dict(grads0=(5, 5e-3))])
def test_a_difference_beyond_the_noise_fails(references, changes):
    ref = references[("adamw", "bf16", False, "")]
    with pytest.raises(AssertionError):
        parity.assert_parity(_run(**changes), ref, "bad", key=("adamw", "bf16", False, ""))
