"""HybridAdam with torch.compile'd models: the same training as without compile, and with
``param_sync="forward"`` a compiled module waits for every parameter under it (its submodules'
hooks do not run inside the compiled graph)."""

from __future__ import annotations

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(compile_: str, sync: str, steps: int = 4):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_layers=3, seq_len=16)
    run = model
    if compile_ == "whole":
        run = torch.compile(model, backend="aot_eager")
    elif compile_ == "blocks":
        for block in model.blocks:
            block.compile(backend="aot_eager")
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=1024,
                     param_sync=sync)
    losses = []
    for step in range(steps):
        _, loss = run(*make_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return losses, params


@pytest.mark.parametrize("compile_", ["whole", "blocks"])
@pytest.mark.parametrize("sync", ["step", "forward"])
def test_compiled_model_trains_as_eager(compile_, sync):
    ref_losses, ref_params = _train("", sync)
    losses, params = _train(compile_, sync)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_a_compiled_wrapper_waits_for_every_parameter_under_it():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_layers=3, seq_len=16)
    compiled = torch.compile(model, backend="aot_eager")
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=1.0, chunk_numel=1024,
                     param_sync="forward")
    model(*make_batch(0))[1].backward()
    opt.step()  # returns at once; the next forward waits per module
    assert opt._pending
    opt._before_forward(compiled, ())  # the wrapper has no parameters of its own
    assert not opt._pending, "a compiled wrapper must complete the whole step"
    opt.close()
