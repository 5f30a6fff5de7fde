"""Counting the memory torch ops allocate: :class:`FreshBytes`, a dispatch mode that adds up the
bytes of every new storage an op returns (the tests of what closing a run allocates, Note
[closing without a copy] in tiermem/stream/closing.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FreshBytes(TorchDispatchMode):
    """While active on this thread: ``bytes`` (the bytes of every storage an op returned that
    none of its inputs had: a copy, a new tensor; views and in-place results are not counted)
    and ``largest`` (the largest such storage, bytes). Other threads are not seen (a dispatch
    mode is thread-local)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self.bytes += storage.nbytes()
                    self.largest = max(self.largest, storage.nbytes())
        return out
