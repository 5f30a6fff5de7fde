"""Autograd's in-place check for tensors saved through the offload hooks.

Note [saved versions]: on unpack, autograd raises when a saved tensor was modified in place
since it was saved (its version counter, shared by the tensor, its views and ``detach()``,
moved on), but only for tensors saved *without* saved-tensor hooks: with hooks the hooks own
the data and autograd checks nothing. Under ``offload_activations`` every saved tensor goes
through the hooks, so the offloader makes the check itself, for every saved tensor, kept or
offloaded: the pack hook records ``t._version``, the unpack hook compares it with the
counter's value now and raises autograd's ``RuntimeError`` (plus where the tensor was saved).
A kept tensor's handle holds ``t.detach()``, which shares the counter. An offloaded tensor's
device memory must be freed, so its handle holds a *tracker* (:func:`version_tracker`): an
alias made by ``detach()`` whose ``.data`` is then set to an empty tensor. ``set_data`` swaps
the alias's storage but keeps its version counter and bumps no version, so the tracker sees
every later in-place write through any alias of the tensor without keeping its storage alive
(once the storage is gone nothing can write it, and the tracker keeps reading the last
version). A tensor modified between its save and its offload (one saved outside every block
before its block starts, or a timed forward's deferred one) is not offloaded: it stays on the
device as saved, and its unpack raises like any other.
"""

from __future__ import annotations

from typing import Hashable

import torch

BACKWARD = "backward"
"""``where`` of a tensor saved while backward runs (checkpoint recomputation, double
backward)."""

_EMPTY: dict[torch.device, torch.Tensor] = {}  # device -> the empty storage trackers point at


def version_tracker(t: torch.Tensor) -> torch.Tensor:
    """Return an empty tensor sharing ``t``'s version counter (Note [saved versions]).

    Its ``_version`` follows in-place writes to ``t`` or any view of it; it keeps none of
    ``t``'s memory alive (its storage is an empty one shared by all trackers of the device).

    Raises:
        RuntimeError: ``t`` is not a strided tensor (``detach``/``set_data`` refuse it).
    """
    empty = _EMPTY.get(t.device)
    if empty is None:
        empty = _EMPTY.setdefault(t.device, torch.empty(0, dtype=torch.uint8, device=t.device))
    alias = t.detach()
    alias.data = empty  # keeps alias's version counter; bumps no version
    return alias


def describe(where: Hashable) -> str:
    """Where a tensor was saved, in words: ``where`` is a block index, an offload group
    ``(forward, block)`` or ``(forward, ("region", n))``, :data:`BACKWARD`, or None."""
    if isinstance(where, tuple) and len(where) == 2:
        where = where[1]
    if where is None:
        return "outside every block"
    if where == BACKWARD:
        return "during backward (recomputation or double backward)"
    if isinstance(where, tuple):
        return "an offload_tensors region"
    return f"block {where}"


class Kept:
    """A saved tensor that stays on the device: the tensor (detached: shares the version
    counter), its version when saved and where it was saved."""

    __slots__ = ("tensor", "version", "where")

    def __init__(self, tensor: torch.Tensor, where: Hashable) -> None:
        self.tensor = tensor
        self.version = tensor._version
        self.where = where

    def unpack(self) -> torch.Tensor:
        """The tensor, after autograd's in-place check.

        Raises:
            RuntimeError: it was modified in place since it was saved (Note [saved versions]).
        """
        t = self.tensor
        if t._version != self.version:
            raise modified_error(self.version, t._version, t.dtype, tuple(t.size()), t.device,
                                 self.where, None)
        return t


def check_version(saved: int, alias: torch.Tensor, dtype: torch.dtype, size: tuple,
                  device: torch.device, where: Hashable, tier: str | None) -> None:
    """Raise autograd's error if ``alias`` (the kept tensor or its tracker) has moved past
    version ``saved``; ``tier``: where the tensor was offloaded (None: kept on the device).

    Raises:
        RuntimeError: the tensor was modified in place since it was saved.
    """
    now = alias._version
    if now != saved:
        raise modified_error(saved, now, dtype, size, device, where, tier)


def modified_error(saved: int, now: int, dtype: torch.dtype, size: tuple, device: torch.device,
                   where: Hashable, tier: str | None) -> RuntimeError:
    """Autograd's in-place error (its wording and hint), naming where the tensor was saved."""
    kind = torch.empty(0, dtype=dtype, device=device).type()
    if torch.is_anomaly_enabled():
        hint = ("Hint: the backtrace further above shows the operation that failed to compute "
                "its gradient. The variable in question was changed in there or anywhere later.")
    else:
        hint = ("Hint: enable anomaly detection to find the operation that failed to compute "
                "its gradient, with torch.autograd.set_detect_anomaly(True).")
    place = "kept on the device" if tier is None else f"offloaded to the {tier!r} tier"
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{kind} {list(size)}] is at version {now}; expected version {saved} "
        f"instead. {hint} offload_activations: the tensor was saved in {describe(where)} and "
        f"{place}; it was changed in place after the forward saved it (autograd skips this "
        f"check under saved-tensor hooks; Note [saved versions] in "
        f"tiermem/offload/versions.py): use an out-of-place op, or change it after backward")
