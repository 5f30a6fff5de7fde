"""How a WeightStream's parameters end when it closes (Note [closing without a copy]).

Note [closing without a copy]: ``WeightStream.close()`` makes every streamed parameter an
ordinary parameter again, on the device it had before, so its weight (and gradient) is copied
out of the store before the store key is deleted. That copy is new memory on top of all that
training held: the store's pool keeps its pinned slabs until the store closes (and torch's
pinned allocator caches them after that), so deleting the keys gives nothing back. The 13B
plan run on the H200 (its 28 streamed blocks materialised on the CPU: 16.4 GiB of weights)
printed its summary at 112.8 GiB of peak RSS and was then killed by the kernel's OOM killer
(rc 137 on a 128 GiB host) in ``close()``, copying the streamed weights to pageable RAM: memory
training never needed. A caller that drops the model after closing (examples/train_large.py
at its end) passes ``restore=False``: each streamed parameter's data becomes the empty
placeholder a released parameter has during a pass (on its home device: any use fails on its
shape), its gradient None, and nothing is copied or read back from NVMe; the hooks, the store
keys and the registries go as with ``restore=True``, so closing allocates nothing. The stream
also lets go of the host gradients and staging tensors it kept (pinned on CUDA).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from tiermem.stream.checks import placeholder


def read_back(entries: Sequence[Any], home: Any, restore: bool) -> list[torch.Tensor] | None:
    """The weights homed on NVMe (``home``: Note [NVMe home]) read back onto their devices,
    all reads first, when ``restore``; else None (Note [closing without a copy]).

    Raises:
        SpillError, SpillCorruption, TierFullError: a read failed (nothing changed).
    """
    if home is None or not restore:
        return None
    return home.restore(entries)


def end_params(blocks: Sequence[Any], back: list[torch.Tensor] | None, store: Any, tier: str,
               restore: bool) -> None:
    """Make each streamed parameter of ``blocks`` ordinary again and delete its store key:
    with ``restore`` its data is ``back``'s tensor (NVMe home) or a copy of its host copy on
    its home device, and its gradient copied there; without, its data an empty placeholder
    and its gradient None (Note [closing without a copy]).

    Raises:
        nothing beyond torch's copy errors.
    """
    for block in blocks:
        for p in block.params:
            if restore:
                p.param.data = back.pop(0) if back is not None else \
                    p.host.detach().to(p.home_device, copy=True)
                grad = p.param.grad
                if grad is not None:
                    p.param.grad = grad.to(p.home_device, copy=True)
            else:
                p.param.grad = None
                p.param.data = placeholder(p.param.dtype, p.home_device)
                p.acc = p.staging = p.dev_sum = None  # the stream keeps no host gradient
            if tier == "cpu":
                store.release(p.key)
            store.delete(p.key)
