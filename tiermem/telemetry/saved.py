"""Counting what autograd saves: the bytes of a forward's saved activations, each storage once.

The demo's baseline row, ``tiermem tune``'s workload sizing and the planner's measured block
formula (tests/test_plan.py) all count saved activations the same way: a
``saved_tensors_hooks`` pair whose pack records each unique storage's bytes, parameters
excluded. Used without an offloader (saved-tensor hooks do not nest with it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedBytesCounter:
    """``saved_tensors_hooks`` that count the bytes of the unique storages autograd saves.

    Args:
        exclude: storage ``data_ptr`` s not to count (the parameters').
        blocks: modules whose forwards are watched: ``block_bytes`` counts the storages first
            saved inside one of them (forward hooks, removed by :meth:`close`).

    ``forward_bytes`` and ``block_bytes`` count since the last :meth:`reset`, in bytes.
    """

    def __init__(self, exclude: Iterable[int] = (), blocks: Iterable[torch.nn.Module] = ()
                 ) -> None:
        self.exclude = set(exclude)
        self.seen: set[int] = set()
        self.forward_bytes = 0
        self.block_bytes = 0
        self._inside = False
        self._handles = [h for b in blocks for h in (
            b.register_forward_pre_hook(lambda m, a: self._enter(True)),
            b.register_forward_hook(lambda m, a, o: self._enter(False)))]

    def _enter(self, inside: bool) -> None:
        self._inside = inside

    def reset(self) -> None:
        """Forget what was counted."""
        self.seen.clear()
        self.forward_bytes = self.block_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: count ``t``'s storage once (strided tensors; sparse ones have none)."""
        if t.layout == torch.strided:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.forward_bytes += s.nbytes()
                if self._inside:
                    self.block_bytes += s.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        """The unpack hook: the tensor itself."""
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that counts what autograd saves inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def close(self) -> None:
        """Remove the block hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
