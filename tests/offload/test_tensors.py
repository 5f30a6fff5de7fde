"""Tensor-level offload (Note [offload rules], rule 10): regions and marked tensors train
exactly as without offload, alone or inside offload_activations, with checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import TinyGPT, make_batch
from tiermem.offload import (mark_for_offload, offload_activations, offload_in_modules,
                             offload_tensors)


pytestmark = pytest.mark.usefixtures("one_thread")


class LoRALinear(nn.Module):
    """A frozen base linear plus a trainable low-rank update, its path optionally offloaded."""

    def __init__(self, base: nn.Linear, rank: int = 4, region=None, mark: bool = False) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.region, self.mark = region, mark

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mark:
            x = mark_for_offload(x * 1.0)  # a tensor of the adapter path, marked
        if self.region is None:
            return self.base(x) + self.lora_b(self.lora_a(x))
        with self.region:
            return self.base(x) + self.lora_b(self.lora_a(x))


def _model(region=None, mark=False, checkpoint=False) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d_model=64, n_layers=3, seq_len=16, checkpoint_blocks=checkpoint)
    for block in model.blocks:
        block.fc = LoRALinear(block.fc, region=region, mark=mark)
    return model


def _train(model, ctx=None, steps=4):
    """SGD on the adapters (weights change every step, a new batch each); grads and losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(steps):
        if ctx is not None:
            with ctx:
                _, loss = model(*make_batch(step))
        else:
            _, loss = model(*make_batch(step))
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.sub_(0.05 * p.grad)
                p.grad = None
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in params]


def _assert_same(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_a_region_alone_offloads_the_adapter_path_exactly(make_store):
    ref = _train(_model())
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    region = offload_tensors(store=store)
    got = _train(_model(region=region))
    _assert_same(got, ref)
    stats = region.stats()
    assert stats["offloaded"] > 0 and stats["reloads"] > 0 and stats["prefetches"] > 0
    assert region.live_keys == 0 and len(store) == 0


@pytest.mark.parametrize("checkpoint", [False, True])
def test_regions_inside_offload_activations_use_its_store(make_store, checkpoint):
    ref = _train(_model(checkpoint=checkpoint))
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    region = offload_tensors()
    model = _model(region=region, checkpoint=checkpoint)
    off = offload_activations(model.blocks, store=store, layers=[1])
    got = _train(model, off)
    _assert_same(got, ref)
    assert region.store is None  # never entered alone: no store of its own
    assert off.stats()["offloaded"] > 0 and off.live_keys == 0


def test_marked_tensors_are_offloaded_in_kept_blocks(make_store):
    ref = _train(_model(mark=True))
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    model = _model(mark=True)
    off = offload_activations(model.blocks, store=store, layers=[])  # every block kept
    got = _train(model, off)
    _assert_same(got, ref)
    assert off.stats()["offloaded"] > 0  # only the marked tensors


def test_a_region_with_another_store_than_the_active_context_is_refused(make_store):
    model = _model(region=offload_tensors(store=make_store()))
    off = offload_activations(model.blocks, store=make_store(), layers=[0])
    with pytest.raises(ValueError, match="another store is active"):
        with off:
            model(*make_batch(0))


def test_mark_for_offload_rejects_non_tensors():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        mark_for_offload([1.0])


def test_a_region_alone_inside_checkpointed_blocks_leaves_checkpoint_in_charge(make_store):
    ref = _train(_model(checkpoint=True))
    region = offload_tensors(store=make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20))
    got = _train(_model(region=region, checkpoint=True))
    _assert_same(got, ref)
    assert region.stats()["offloaded"] == 0  # checkpoint saved nothing there to offload


def _adapters(model) -> list[nn.Module]:
    return [m for block in model.blocks for m in (block.fc.lora_a, block.fc.lora_b)]


def test_module_regions_offload_what_the_modules_save_exactly(make_store):
    """offload_in_modules: hooks enter one region around every adapter call; training (weights
    change every step, a new batch each) is bit-identical to no offload, what the adapters save
    is offloaded and prefetched back, nothing else; close() removes the hooks."""
    ref = _train(_model())
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    model = _model()
    regions = offload_in_modules(_adapters(model), store=store)
    got = _train(model)
    _assert_same(got, ref)
    stats = regions.stats()
    assert stats["offloaded"] > 0 and stats["reloads"] > 0 and stats["prefetches"] > 0
    # per step: each adapter pair saves lora_a's input and output (3 blocks x 2), no more
    assert stats["offloaded"] == 4 * 3 * 2
    regions.close()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in _adapters(model))
    assert regions.region.live_keys == 0 and len(store) == 0


@pytest.mark.parametrize("checkpoint", [False, True])
def test_module_regions_inside_offload_activations_join_it(make_store, checkpoint):
    ref = _train(_model(checkpoint=checkpoint))
    store = make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20)
    model = _model(checkpoint=checkpoint)
    regions = offload_in_modules(_adapters(model), store=store)
    off = offload_activations(model.blocks, store=store, layers=[1])
    got = _train(model, off)
    _assert_same(got, ref)
    assert off.stats()["offloaded"] > 0 and off.live_keys == 0
    regions.close()


def test_a_module_that_raises_still_leaves_the_region(make_store):
    model = _model()
    regions = offload_in_modules([model.blocks[0].fc.lora_a], store=make_store())
    bad = torch.zeros(2, 16, 7)  # wrong width: lora_a raises inside the region
    with pytest.raises(RuntimeError):
        model.blocks[0].fc(bad)
    assert not regions.region._host  # left: the next forward starts outside any region
    _, loss = model(*make_batch(0))
    loss.backward()
    regions.close()


def test_offload_in_modules_rejects_bad_input():
    with pytest.raises(ValueError, match="modules is empty"):
        offload_in_modules([])
    with pytest.raises(TypeError, match="expected nn.Module elements, got Tensor"):
        offload_in_modules([torch.zeros(1)])


def test_a_region_alone_never_offloads_a_weight(make_store, held_puts):
    """Note [offload rules], rule 1: inside a region there are no blocks, yet the frozen base
    weight (saved as ``weight.t()``, a view) and the adapters' weights are not copied out; only
    activations are."""
    region = offload_tensors(store=make_store(gpu_bytes=8 << 20, cpu_bytes=8 << 20))
    model = _model(region=region)
    _train(model, steps=1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    put = {t.untyped_storage().data_ptr() for t in held_puts}
    assert held_puts and not weights & put
