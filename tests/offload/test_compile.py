"""Activation offload under torch.compile (Note [offload rules], rule 9).

Blocks compiled one by one train bit-identically with and without offload; a whole-model
compile is split at the block boundaries (fusions across blocks round differently); a graph
compiled before the hooks existed is refused, never a silent no-op. CPU with ``aot_eager``
(no code generation: fast) and one inductor run; the CUDA versions are in
tests/test_cuda_training_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem.offload import offload_activations


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compiled graphs of one test must not serve another
    yield
    torch._dynamo.reset()


def _build(mode: str, backend: str):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_layers=4, seq_len=16)
    if mode == "whole":
        return torch.compile(model, backend=backend), model
    if mode == "wrapped":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)
    return model, model


def _train(mode: str, backend: str, offload: bool):
    """Three steps of SGD (weights change every step, a new batch each); returns grads, stats."""
    torch._dynamo.reset()
    run, model = _build(mode, backend)
    off = offload_activations(model.blocks, layers=[0, 2]) if offload else None
    for step in range(3):
        if off is not None:
            with off:
                _, loss = run(*make_batch(step))
        else:
            _, loss = run(*make_batch(step))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
        if step < 2:
            model.zero_grad(set_to_none=True)
    return [p.grad.clone() for p in model.parameters()], (off.stats() if off else None)


@pytest.mark.parametrize("mode", ["whole", "wrapped", "inplace"])
def test_compiled_models_offload_and_train_exactly(mode):
    ref, _ = _train(mode, "aot_eager", offload=False)
    got, stats = _train(mode, "aot_eager", offload=True)
    assert stats["offloaded"] > 0 and stats["reloads"] > 0
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"gradient {i}: max diff {(a - b).abs().max()}"


def test_inductor_blocks_exact_and_whole_model_within_rounding():
    ref, _ = _train("inplace", "inductor", offload=False)
    got, stats = _train("inplace", "inductor", offload=True)
    assert stats["offloaded"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    ref, _ = _train("whole", "inductor", offload=False)
    got, stats = _train("whole", "inductor", offload=True)
    assert stats["offloaded"] > 0
    for a, b in zip(got, ref):  # fusions across block boundaries: fp32 rounding only
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_graph_compiled_before_the_hooks_is_refused_not_ignored():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=32, n_layers=4, seq_len=16)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(*make_batch(0))[1].backward()  # compiled without hooks: dynamo does not guard them
    off = offload_activations(model.blocks, layers=[0, 2])
    with pytest.raises(RuntimeError, match="none of the 4 blocks' forward hooks ran"):
        with off:
            _, loss = compiled(*make_batch(1))
    loss.backward()  # the graph still trains (nothing was offloaded), and the object is usable
    assert off.live_keys == 0
    with off:
        _, loss = model(*make_batch(2))  # an eager forward offloads again
    loss.backward()
    assert off.stats()["offloaded"] > 0
