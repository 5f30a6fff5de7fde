"""Tensors whose storage is exactly their own bytes, without a copy (Note [exact storage]).

Note [exact storage]: ``torch.save`` writes the *whole* storage under every tensor it saves,
not the tensor's bytes, and ``torch.save``, safetensors and transformers' ``save_pretrained``
tell tensors apart by their storage's address. A tensor the store hands out from its ``"cpu"``
tier is a view into a pool slab (Note [slab tail] in tiermem/store/pool.py: 1 MiB to 1 GiB,
shared by every block cut from it), so saving one wrote the slab: other keys' bytes (e.g.
HybridAdam's optimizer state in the same store) went into the file, two such tensors of
different dtypes in one slab made ``torch.save`` refuse ("Cannot save multiple tensors or
storages that view the same data as different types"), and the checkpoint was as large as
the slabs. :func:`exact_storage` returns a tensor over the same memory whose storage is a
slice of the original one: ``UntypedStorage.__getitem__`` with a slice (``THPStorage_get`` in
torch/csrc/Storage.cpp, the same from torch 2.0 to 2.11 and this 2.13) makes a non-resizable
storage of those bytes whose deleter holds a reference to the original storage, so the
memory stays valid as long as the slice lives, whatever the pool does with its slab list
(pinned-ness is a property of the address, kept). What the bytes *mean* is the owner's
business: a pool block freed and handed to another key is overwritten while the slice still
points at it, so whoever hands a slice out must end that before the block is freed
(Note [exact state dict storage] in tiermem/stream/state_dicts.py).
"""

from __future__ import annotations

import torch


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte, bytes)`` of the storage range ``t``'s elements occupy."""
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # strides are >= 0 in torch
    return t.storage_offset() * size, (last + 1) * size


def owns_exactly(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is exactly the bytes its elements occupy (``torch.save`` writes
    no other byte), or it has no bytes to write (empty, meta).

    Raises:
        nothing.
    """
    if t.numel() == 0 or t.device.type == "meta":
        return True
    start, nbytes = _span(t)
    return start == 0 and nbytes == t.untyped_storage().nbytes()


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s values, dtype, shape and strides, over the same memory (no copy),
    whose storage holds exactly the bytes its elements occupy (Note [exact storage]). It does
    not require grad and has its own version counter (assign it to a tensor's ``.data`` to keep
    that tensor's). ``t`` itself when it already owns its storage exactly (detached).

    Args:
        t: a dense tensor on any device (a CPU pool view in tiermem's use).

    Raises:
        nothing beyond torch's own errors for a tensor without a storage (a sparse tensor).
    """
    if owns_exactly(t):
        return t.detach()
    start, nbytes = _span(t)
    piece = t.untyped_storage()[start:start + nbytes]
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(piece, 0, t.shape, t.stride())
