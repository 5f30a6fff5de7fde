"""Note [model state dicts after a forward-synced step]: ``model.state_dict()`` right after a
``param_sync="forward"`` ``step()`` holds that step's weights (the worker still writing them is
waited for), and ``model.load_state_dict`` there is not overwritten by the write-back."""

from __future__ import annotations

import copy

import pytest
import torch

from tiermem.optim import HybridAdam
from tiermem.optim import chunk_worker
from tiermem.optim.forward_sync import ModelHooks

STEPS = 8


@pytest.fixture
def slow_worker(monkeypatch):
    """Each CPU Adam call sleeps 5 ms first: the worker is still stepping when ``step()``
    returns (what a large model's step looks like), deterministically."""
    import time
    original = chunk_worker.adam_step_unchecked

    def slow(*args, **kwargs):
        time.sleep(0.005)
        return original(*args, **kwargs)

    monkeypatch.setattr(chunk_worker, "adam_step_unchecked", slow)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step))


def _saved_after_each_step(model, opt) -> list[dict]:
    """``STEPS`` steps; after each ``step()`` the model's state dict is copied at once, as
    ``torch.save(model.state_dict())`` would write it."""
    saved = []
    for step in range(STEPS):
        model(_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
    return saved


def _reference() -> list[dict]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return _saved_after_each_step(model, opt)


def _hybrid(model):
    return HybridAdam(model.parameters(), lr=1e-3, offload_fraction=1.0, chunk_numel=1024,
                      param_sync="forward")


def test_state_dict_right_after_step_holds_that_steps_weights(slow_worker):
    model = _model()
    opt = _hybrid(model)
    saved = _saved_after_each_step(model, opt)
    for step, (got, want) in enumerate(zip(saved, _reference())):
        for key in want:
            assert torch.equal(got[key], want[key]), (step, key)
    opt.close()


def test_the_twin_without_the_hooks_saves_a_half_applied_step(slow_worker, monkeypatch):
    """Must go red: the modules never hooked, a state dict taken right after ``step()`` holds
    weights the worker had not written yet."""
    monkeypatch.setattr(ModelHooks, "see", lambda self, module: None)
    model = _model()
    opt = _hybrid(model)
    saved = _saved_after_each_step(model, opt)
    opt.synchronize()
    ref = _reference()
    stale = sum(not torch.equal(got[k], want[k]) for got, want in zip(saved, ref) for k in want)
    assert stale > 0
    opt.close()


def test_load_right_after_step_is_not_overwritten(slow_worker):
    model = _model()
    other = {k: v + 1.0 for k, v in copy.deepcopy(model).state_dict().items()}
    opt = _hybrid(model)
    model(_batch(0)).square().mean().backward()
    opt.step()  # the worker still writes the params
    model.load_state_dict(other)  # completes the step first, then loads
    opt.synchronize()
    for key, value in model.state_dict().items():
        assert torch.equal(value, other[key]), key
    opt.zero_grad(set_to_none=True)
    model(_batch(1)).square().mean().backward()  # and training goes on from the loaded values
    opt.step()
    opt.synchronize()
    opt.close()


def test_close_removes_the_model_hooks():
    model = _model()
    opt = _hybrid(model)
    model(_batch(0)).square().mean().backward()
    opt.step()
    opt.synchronize()
    assert any(m._state_dict_pre_hooks for m in model.modules())
    opt.close()
    assert not any(m._state_dict_pre_hooks for m in model.modules())
    assert not any(m._load_state_dict_pre_hooks for m in model.modules())
