"""Autograd's in-place check under activation offload (Note [saved versions] in
tiermem/offload/versions.py): where plain autograd raises because a saved tensor was modified
in place, offload raises too (kept and offloaded tensors, cpu and nvme tiers, with and without
checkpointing); where autograd allows an in-place op, training is bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tiermem.offload import offload_activations
from tiermem.offload.versions import version_tracker

pytestmark = pytest.mark.usefixtures("one_thread")

MODIFIED = "one of the variables needed for gradient computation has been modified by an inplace"
D = 64  # width; a (8, 64) fp32 activation is 2 KiB, over the default min_offload_bytes


class _Block(nn.Module):
    """Linear (saves its input) then GELU (saves its input); remembers its input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return nn.functional.gelu(self.lin(x))


class _Net(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor, before_block=None) -> torch.Tensor:
        h = torch.tanh(self.inp(x))  # saved by tanh outside every block
        for i, block in enumerate(self.blocks):
            if before_block is not None:
                before_block(i, h)
            h = checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h)
        return h.square().mean()


def _net(ckpt: bool) -> _Net:
    torch.manual_seed(0)
    return _Net(ckpt)


def _x() -> torch.Tensor:
    return torch.randn(8, D, generator=torch.Generator().manual_seed(1))


def _after_forward(block: int):
    """Modify block ``block``'s input (saved by its Linear) in place after the forward."""
    def modify(net, loss):
        with torch.no_grad():
            net.blocks[block].seen.mul_(1.5)
    return modify


def _before_block(block: int):
    """Modify the tensor block ``block`` gets, saved outside every block by tanh (its output),
    after the save and before the block starts (a pending tensor: Note [offload rules], 1)."""
    def hook(i, h):
        if i == block:
            with torch.no_grad():
                h.mul_(1.5)
    return hook


def _step_weights(net, loss):
    """An optimizer step between forward and backward: the saved weights change."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01)


OUTSIDE = "outside every block"
# (name, offload kwargs, after-forward modification, before-block hook, where it was saved
# (without, with checkpointing: a checkpointed block's input is saved just before the block;
# None: plain autograd does not raise))
CASES = [
    ("kept: last block", dict(layers=[0, 1, 2]), _after_forward(3), None, ("block 3", OUTSIDE)),
    ("kept: under min_offload_bytes", dict(layers=[0, 1, 2, 3], min_offload_bytes=1 << 30),
     _after_forward(1), None, ("block 1", OUTSIDE)),
    # checkpointed blocks save no weight in forward: nothing to raise about, with or without
    ("kept: weights", dict(layers=[0, 1, 2, 3]), _step_weights, None, ("block 3", None)),
    ("offloaded", dict(layers=[0, 1, 2, 3]), _after_forward(2), None, ("block 2", "block 2")),
    ("saved outside a block, changed before it", dict(layers=[0, 1, 2, 3]), None,
     _before_block(0), (OUTSIDE, OUTSIDE)),
]


def _run(net, modify, hook, off=None):
    def fwd():
        loss = net(_x(), hook)
        if modify is not None:
            modify(net, loss)
        return loss
    if off is None:
        return fwd().backward()
    with off:
        loss = fwd()
    loss.backward()


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name, kw, modify, hook, where", CASES, ids=[c[0] for c in CASES])
def test_inplace_change_of_a_saved_tensor_raises_as_autograd_does(make_store, ckpt, tier, name,
                                                                  kw, modify, hook, where):
    store = make_store()
    net = _net(ckpt)
    off = offload_activations(net.blocks, store=store, tier=tier, **kw)
    if where[ckpt] is None:  # autograd allows it: so does offload, with the same gradients
        ref = _net(ckpt)
        _run(ref, modify, hook)
        _run(net, modify, hook, off)
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.equal(a.grad, b.grad)
        return
    with pytest.raises(RuntimeError, match=MODIFIED):  # plain autograd
        _run(_net(ckpt), modify, hook)
    with pytest.raises(RuntimeError, match=MODIFIED) as info:
        _run(net, modify, hook, off)
    msg = str(info.value)
    assert "expected version" in msg and f"saved in {where[ckpt]}" in msg, msg
    assert "set_detect_anomaly" in msg and "Note [saved versions]" in msg
    offloaded = "offloaded to the" in msg
    if name == "offloaded":
        assert offloaded and f"{tier!r} tier" in msg
        assert off.stats()["offloaded"] > 0
    elif name.startswith("kept") or hook is not None:
        assert not offloaded and "kept on the device" in msg
    # the offloader stays usable: a clean step trains and frees every key
    del info  # its traceback holds the failed step's graph (the frames' locals)
    ref = _net(ckpt)
    net.load_state_dict(ref.state_dict())
    net.zero_grad(set_to_none=True)
    _run(net, None, None, off)
    _run(ref, None, None)
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert off.live_keys == 0 and len(store) == 0


class _InplaceBlock(nn.Module):
    """In-place ops autograd allows: a scalar mul_ and ReLU(inplace=True) on a Linear's output
    (addmm saves no output; the mul saves nothing; relu_ saves its result, changed no more), an
    in-place residual add on another Linear's output, and sigmoid's saved output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.relu = nn.ReLU(inplace=True)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.mul_(0.5)  # before relu_ saves h (after, it would change relu's saved result)
        y = self.out(self.relu(h))
        y += x  # y is addmm's output, not saved
        return torch.sigmoid(y) * 2


def _train(offload, ckpt: bool, make_store=None, tier="cpu") -> tuple[list, list]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_InplaceBlock() for _ in range(4))
    opt = torch.optim.AdamW(blocks.parameters(), lr=1e-2)
    off = offload_activations(blocks, store=make_store(), tier=tier, layers=[0, 1, 2]) \
        if offload else None
    losses = []
    for step in range(8):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(100 + step))
        if off is not None:
            off.__enter__()
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
        loss = h.square().mean()
        if off is not None:
            off.__exit__(None, None, None)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if off is not None:
        assert off.stats()["offloaded"] > 0 and off.live_keys == 0
    return losses, [p.detach().clone() for p in blocks.parameters()]


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_no_false_positive_in_training_with_allowed_inplace_ops(make_store, ckpt, tier):
    ref_losses, ref_params = _train(False, ckpt)
    losses, params = _train(True, ckpt, make_store, tier)
    assert losses == ref_losses
    assert ref_losses[0] != ref_losses[-1]  # it trains
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)


def test_version_tracker_follows_views_without_keeping_memory():
    import weakref
    x = torch.randn(16, 16)
    tracker = version_tracker(x)
    view = x[:, :4]
    storage = weakref.ref(x.untyped_storage())
    assert tracker._version == x._version == 0 and tracker.untyped_storage().nbytes() == 0
    del x
    view.mul_(2)
    assert tracker._version == 1
    del view
    assert storage() is None and tracker._version == 1
