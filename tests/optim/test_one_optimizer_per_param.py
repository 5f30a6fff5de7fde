"""Note [one optimizer per param]: a second HybridAdam over parameters an open one already steps
is refused at construction (both would step them during backward); closing or dropping the
first frees them, and the second then trains exactly as AdamW."""

from __future__ import annotations

import gc

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, assert_params_close, make_models
from tiermem.optim import HybridAdam
from tiermem.optim import lifetime

KW = dict(**HP, offload_fraction=1.0, chunk_numel=1024)


def _steps(model, opt, start: int, n: int) -> None:
    for step in range(start, start + n):
        model(*make_batch(step))[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_second_optimizer_over_open_ones_params_is_refused():
    model = make_models()
    first = HybridAdam(model.parameters(), **KW)
    _steps(model, first, 0, 2)
    with pytest.raises(ValueError, match=r"param 0 \(shape .*\) is already stepped by another "
                                         r"HybridAdam that is still open.*close\(\)"):
        HybridAdam(model.parameters(), **KW)
    _steps(model, first, 2, 2)  # the first is untouched by the refusal
    first.close()


@pytest.mark.parametrize("end", ["close", "drop"])
def test_after_close_or_drop_the_next_optimizer_trains_as_adamw(end):
    model, ref = make_models(), make_models()
    first = HybridAdam(model.parameters(), **KW)
    _steps(model, first, 0, 2)
    first.synchronize()
    if end == "close":
        first.close()
    del first
    gc.collect()
    ref.load_state_dict(model.state_dict())
    second = HybridAdam(model.parameters(), **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    _steps(model, second, 2, 8)
    _steps(ref, ref_opt, 2, 8)
    second.synchronize()
    assert_params_close(model, ref, exact=True)
    second.close()


def test_the_twin_without_the_claim_has_two_optimizers_stepping(monkeypatch):
    """Must go red: the claim taken out, the first optimizer (still open) steps the params too
    during the second one's backward, and the run leaves AdamW's (or fails on a race)."""
    monkeypatch.setattr(lifetime, "_open", lambda opt: False)
    model, ref = make_models(), make_models()
    first = HybridAdam(model.parameters(), **KW)
    _steps(model, first, 0, 1)
    first.synchronize()
    ref.load_state_dict(model.state_dict())
    second = HybridAdam(model.parameters(), **KW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    _steps(ref, ref_opt, 1, 4)
    try:
        _steps(model, second, 1, 4)
        second.synchronize()
        first.synchronize()
        with pytest.raises(AssertionError):
            assert_params_close(model, ref, exact=False)
    except RuntimeError as exc:  # the race detected instead: also not AdamW's run
        assert "changed while the step was still updating it" in str(exc)
    first.close()
    second.close()


def test_other_params_are_free():
    a, b = make_models(), make_models(seed=1)
    first = HybridAdam(a.parameters(), **KW)
    second = HybridAdam(b.parameters(), **KW)  # another model's params: no refusal
    first.close()
    second.close()
