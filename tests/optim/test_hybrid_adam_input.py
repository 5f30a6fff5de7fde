"""Issue 27.8: what torch.optim.AdamW accepts or refuses, HybridAdam accepts or refuses too,
with a clear message: frozen params, amsgrad states, sparse gradients, non-finite
hyper-parameters (Note [finite hyper-parameters] in tiermem/optim/hyperparams.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, assert_params_close, make_models
from tiermem.optim import HybridAdam


def _steps(model, opt, steps, start=0, unfreeze_at=None):
    for step in range(start, start + steps):
        if step == unfreeze_at:
            model.blocks[0].fc.weight.requires_grad_(True)
        idx, tgt = make_batch(step)
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_frozen_params_are_accepted_skipped_and_stepped_once_unfrozen(fraction, overlap):
    ref = make_models()
    ref.blocks[0].fc.weight.requires_grad_(False)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=fraction, chunk_numel=1024,
                     overlap=overlap)  # raised "cannot register a hook" before
    frozen = model.blocks[0].fc.weight.detach().clone()
    _steps(ref, ref_opt, 4)
    _steps(model, opt, 4)
    assert torch.equal(model.blocks[0].fc.weight, frozen)  # skipped, like AdamW
    _steps(ref, ref_opt, 5, start=4, unfreeze_at=4)
    _steps(model, opt, 5, start=4, unfreeze_at=4)
    assert not torch.equal(model.blocks[0].fc.weight, frozen)
    assert_params_close(model, ref, exact=fraction == 0.0)
    opt.close()


def test_an_amsgrad_state_or_group_is_refused_and_the_optimizer_stays_usable():
    ref = make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, amsgrad=True)
    _steps(ref, ref_opt, 2)
    model = make_models()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024)
    with pytest.raises(ValueError, match=r"amsgrad.*not supported.*AdamW\(amsgrad=True\)"):
        opt.load_state_dict(ref_opt.state_dict())
    state = ref_opt.state_dict()
    state["param_groups"][0]["amsgrad"] = False  # the moments alone still tell
    with pytest.raises(ValueError, match=r"amsgrad state \(max_exp_avg_sq\)"):
        opt.load_state_dict(state)
    assert opt.param_groups[0].get("amsgrad") is None  # nothing of it was taken
    _steps(model, opt, 1)
    opt.close()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\]=True"):
        HybridAdam([{"params": list(model.parameters()), "amsgrad": True}])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_sparse_gradient_is_refused_naming_the_param_and_the_fix(overlap):
    emb = torch.nn.Embedding(100, 16, sparse=True)
    head = torch.nn.Linear(16, 4)
    opt = HybridAdam([*head.parameters(), emb.weight], offload_fraction=1.0, overlap=overlap,
                     placement="given")
    with pytest.raises(TypeError, match=r"param 2 of param group 0 \(shape \(100, 16\)\) got a "
                                        r"torch.sparse_coo gradient.*sparse=False"):
        head(emb(torch.tensor([1, 2, 3]))).sum().backward()
        opt.step()
    opt.close()


@pytest.mark.parametrize("field, value", [("lr", math.inf), ("lr", math.nan), ("eps", math.inf),
                                          ("weight_decay", math.inf),
                                          ("max_grad_norm", math.inf)])
def test_non_finite_hyper_parameters_are_refused_at_construction(field, value):
    model = make_models()
    with pytest.raises(ValueError, match=rf"{field}'?\]?={value!r}"):
        HybridAdam(model.parameters(), **{**HP, field: value})


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("field, value", [("lr", math.inf), ("betas", (0.9, math.nan)),
                                          ("eps", math.inf), ("weight_decay", -math.inf)])
def test_a_non_finite_value_set_before_step_is_refused_and_nothing_is_stepped(
        field, value, overlap, max_grad_norm):
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024,
                     overlap=overlap, max_grad_norm=max_grad_norm)
    _steps(ref, ref_opt, 3)
    _steps(model, opt, 2)
    before = [p.detach().clone() for p in model.parameters()]
    good = opt.param_groups[0][field]
    opt.param_groups[0][field] = value  # e.g. an LR scheduler gone wrong
    idx, tgt = make_batch(2)
    model(idx, tgt)[1].backward()  # with overlap the CPU steps chunks during backward
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['{field}"):
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)  # no NaN, nothing stepped
    opt.param_groups[0][field] = good
    opt.zero_grad(set_to_none=True)
    _steps(model, opt, 1, start=2)  # the same step again, with the fixed value
    if max_grad_norm is None:
        assert_params_close(model, ref, exact=False)
    assert all(p.isfinite().all() for p in model.parameters())
    opt.max_grad_norm = math.inf
    with pytest.raises(ValueError, match="max_grad_norm=inf"):
        opt.step()
    opt.close()
