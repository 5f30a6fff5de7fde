"""CUDA graphs and activation offload (Note [offload rules], rule 11; Note [cuda graphs]):
a tensor that would be offloaded while a stream captures a graph is refused with a clear
error, the offloader stays usable, and blocks the policy keeps are not refused."""

from __future__ import annotations

import pytest
import torch

import tiermem._graphs as graphs
from models import TinyGPT, make_batch
from tiermem.offload import offload_activations, offload_tensors

pytestmark = pytest.mark.usefixtures("one_thread")


def _losses(model, ctx, steps=3):
    out = []
    for step in range(steps):
        with ctx:
            _, loss = model(*make_batch(step))
        loss.backward()
        out.append(loss.item())
    return out


def _model():
    torch.manual_seed(0)
    return TinyGPT(vocab=64, d_model=32, n_layers=3, seq_len=16)


def test_capture_is_refused_and_the_offloader_stays_usable(make_store, monkeypatch):
    model = _model()
    off = offload_activations(model.blocks, store=make_store(), layers=[0, 1])
    monkeypatch.setattr(graphs, "capturing", lambda t=None: True)
    with pytest.raises(RuntimeError, match=r"offload_activations: saving a tensor to offload ran "
                                           r"inside a CUDA graph capture.*rule 11"):
        with off:
            model(*make_batch(0))
    monkeypatch.undo()
    model.zero_grad(set_to_none=True)
    got = _losses(model, off)
    grads = [p.grad.clone() for p in model.parameters()]
    ref_model = _model()
    ref = []
    for step in range(3):
        _, loss = ref_model(*make_batch(step))
        loss.backward()
        ref.append(loss.item())
    assert got == ref
    for g, r in zip(grads, (p.grad for p in ref_model.parameters())):
        assert torch.equal(g, r)


def test_kept_blocks_are_not_refused(make_store, monkeypatch):
    model = _model()
    off = offload_activations(model.blocks, store=make_store(), layers=[])
    monkeypatch.setattr(graphs, "capturing", lambda t=None: True)
    with off:  # nothing is offloaded, so nothing is refused
        _, loss = model(*make_batch(0))
    loss.backward()


def test_a_region_is_refused(make_store, monkeypatch):
    model = _model()
    monkeypatch.setattr(graphs, "capturing", lambda t=None: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with offload_tensors(store=make_store()):
            model(*make_batch(0))


def test_capturing_is_false_for_cpu_tensors():
    assert not graphs.capturing(torch.ones(1))
    graphs.refuse_capture("x", "y", "z", torch.ones(1))  # a CPU tensor never refuses


@pytest.mark.cuda
def test_a_real_capture_of_an_offloaded_block_is_refused(tmp_path):
    from tiermem import StoreConfig, TierStore
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=64, n_layers=2, seq_len=16).cuda()
    store = TierStore(StoreConfig(gpu_bytes=64 << 20, cpu_bytes=64 << 20))
    x = torch.randn(4, 16, 64, device="cuda", requires_grad=True)
    try:
        with offload_activations(model.blocks, store=store, layers=[0, 1]):
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                # a function, not the block: torch refuses modules with hooks before capturing
                # ("Modules must not have hooks registered at the time they are passed")
                torch.cuda.make_graphed_callables(lambda t: model.blocks[0](t), (x,))
    finally:
        store.close()
