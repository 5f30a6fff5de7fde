"""What the offloader keeps per saved tensor: a :class:`_Record` per offloaded storage (one
store key, shared by the saved tensors on that storage: Note [offload rules], rule 2, in
tiermem/offload/rules.py) and a :class:`_Saved` handle per saved tensor, which the pack hook
returns and whose death releases its record (rule 3). Units: bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch


@dataclass(eq=False)
class _Record:
    """One offloaded storage: a store key shared by the saved tensors on that storage."""

    key: Hashable
    nbytes: int
    group: Hashable
    storage_ref: Any  # weakref to the device storage while it lives (dedup only while alive)
    version: int
    live: int = 0  # handles (saved variables) referring to it
    prefetched: bool = False
    slot: "tuple[int, int, int] | None" = None  # double buffering: (set, generation, offset)


class _Saved:
    """What the pack hook returns: a saved tensor, offloaded (``record``) or kept (``tensor``)."""

    __slots__ = ("owner", "tensor", "record", "group", "dtype", "size", "stride", "offset",
                 "conj", "neg", "version", "marked", "tracker", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", tensor: torch.Tensor,
                 marked: bool = False) -> None:
        self.owner = owner
        # mark_for_offload: offloaded even in a kept block (Note [offload rules], rule 10)
        self.marked = marked
        self.tensor: torch.Tensor | None = tensor
        self.record: _Record | None = None
        self.group: Hashable = None
        self.dtype = tensor.dtype
        self.size = tuple(tensor.size())
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        # lazy conjugate / negative views (a.conj(), a.conj().imag): their bytes are a's, and
        # as_strided does not carry the bit (Note [offload rules], rule 2)
        self.conj = tensor.is_conj()
        self.neg = tensor.is_neg()
        self.version = tensor._version  # a deferred offload must copy what was saved
        self.tracker: torch.Tensor | None = None  # offloaded: Note [saved versions]

    def __del__(self) -> None:
        record = self.record
        if record is not None:
            try:
                self.owner._release(record)
            except Exception:  # interpreter shutdown or a closed store: nothing left to free
                pass
