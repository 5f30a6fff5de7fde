"""Note [frozen hyper-parameters]: a chunk the worker began before ``step()`` keeps the learning
rate it began with, even when the training loop's scheduler changes it before the chunk reads it
(``param_sync="forward"``: ``step()`` returns while the worker still steps chunks)."""

from __future__ import annotations

import threading

import pytest
import torch

from models import make_batch
from optim.test_hybrid_adam import HP, assert_params_close, make_models
from tiermem.optim import HybridAdam
from tiermem.optim.step_state import StepState

WORKER = "tiermem-hybrid-adam"


def _train(model, opt, steps: int, pause_at: int | None = None, monkeypatch=None):
    """``steps`` steps with a scheduler that changes the LR every step. At step ``pause_at`` the
    worker is held right after it took its first chunk's hyper-parameters until ``step()`` has
    returned and the scheduler has stepped: the interleaving a loaded machine produces."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
    entered, release = threading.Event(), threading.Event()
    losses = []
    for step in range(steps):
        idx, tgt = make_batch(step)
        _, loss = model(idx, tgt)  # waits until the last step's chunks are all stepped
        if step == pause_at:  # then hold this step's first chunk
            opt.synchronize()  # (the forward has waited for them all already)
            original = StepState.hyperparams

            def held(self, g, live):
                hp = original(self, g, live)
                if threading.current_thread().name == WORKER and not entered.is_set():
                    entered.set()
                    assert release.wait(60), "the test never released the worker"
                return hp

            monkeypatch.setattr(StepState, "hyperparams", held)
        loss.backward()
        if step == pause_at:  # the first chunk's gradients are complete during backward
            assert entered.wait(60), "the worker did not start a chunk during backward"
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step == pause_at:
            release.set()
            monkeypatch.undo()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("gpu_step_fraction", [0.0, 1.0], ids=["cpu-kernel", "lane"])
def test_a_chunk_begun_before_step_keeps_its_learning_rate(monkeypatch, gpu_step_fraction):
    ref, model = make_models(), make_models()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HP, fused=True)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     param_sync="forward", gpu_step_fraction=gpu_step_fraction)
    ref_losses = _train(ref, ref_opt, 4)
    # step 0 records the gradient order (nothing is stepped early); from step 1 chunks step
    # during backward
    losses = _train(model, opt, 4, pause_at=2, monkeypatch=monkeypatch)
    opt.synchronize()
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6)
    assert_params_close(model, ref, exact=False)
    opt.close()
