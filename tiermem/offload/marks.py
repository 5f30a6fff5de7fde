"""Tensors marked for offload: :func:`tiermem.offload.mark_for_offload` sets :data:`MARK` on a
tensor and remembers its storage, so a kept block still offloads it (Note [offload rules],
rule 10, in tiermem/offload/rules.py)."""

from __future__ import annotations

import weakref

import torch

MARK = "activation_offloading"
"""The tensor attribute :func:`tiermem.offload.mark_for_offload` sets (the name Megatron-Core
uses, so tensors marked for it are honoured too)."""


_MARKED: dict[int, weakref.ref] = {}  # id(storage) -> weakref: storages of marked tensors


def mark_storage(t: torch.Tensor) -> None:
    """Remember ``t``'s storage as marked: ops often save a view of a marked tensor (a linear
    layer saves its input reshaped to 2-D), a new tensor object without the attribute."""
    storage = t.untyped_storage()
    key = id(storage)
    _MARKED[key] = weakref.ref(storage, lambda _, key=key: _MARKED.pop(key, None))


def _is_marked(t: torch.Tensor) -> bool:
    if getattr(t, MARK, False):
        return True
    if not _MARKED or t.layout != torch.strided:
        return False
    storage = t.untyped_storage()
    ref = _MARKED.get(id(storage))
    return ref is not None and ref() is storage
