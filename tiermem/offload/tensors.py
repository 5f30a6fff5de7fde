"""Tensor-level activation offload: a region of code, or single tensors, instead of blocks.

``offload_tensors()`` is a context manager: every tensor autograd saves inside it goes through
a TierStore and comes back, prefetched, in backward, exactly as the tensors of an offloaded
block do (Note [offload rules] in tiermem/offload/rules.py, rule 10). Use it inside any
module, e.g. the adapter path of a LoRA layer::

    regions = offload_tensors()               # make once, enter every forward
    def forward(self, x):
        with regions:
            return self.base(x) + self.lora_b(self.lora_a(x))

``mark_for_offload(t)`` marks one tensor instead: it is offloaded when autograd saves it under
an active ``offload_activations`` context, even inside a block that context keeps.

``offload_in_modules(modules)`` does the entering for you: one region, entered around every
call of the given modules by forward hooks (e.g. every LoRA ``lora_A`` / ``lora_B`` of a peft
model), so only what those modules save is offloaded: the module-level mode for code you do
not want to edit.

Under other saved-tensor hooks (inside ``torch.utils.checkpoint``, ``save_on_cpu``) a region
alone does nothing: those decide what is saved (a checkpointed block saves nothing to offload;
with ``offload_activations`` its input is offloaded with the block).
"""

from __future__ import annotations

import torch

from typing import Iterable

from torch import nn

from tiermem import options
from tiermem.offload.activations import ActivationOffloader
from tiermem.offload.context import _in_backward, active_offloader
from tiermem.offload.marks import MARK, mark_storage
from tiermem.store import TierStore

_D = options.defaults("activations", "api")
"""The arguments' defaults, from the one definition (Note [one definition] in
tiermem/options.py)."""

_NOOP = object()  # an entry with nothing to do (in backward, or under foreign hooks)


def _foreign_hooks_active() -> bool:
    """True if saved-tensor hooks other than tiermem's are active (checkpoint, save_on_cpu)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


class TensorOffloader(ActivationOffloader):
    """The context manager :func:`offload_tensors` returns (see there); reusable."""

    _regions_only = True

    def __init__(self, *, store: TierStore | None = None, tier: str = _D["tier"],
                 prefetch_depth: int = _D["prefetch_depth"],
                 min_offload_bytes: int = _D["min_offload_bytes"]) -> None:
        super().__init__([], store=store, tier=tier, layers=[], prefetch_depth=prefetch_depth,
                         min_offload_bytes=min_offload_bytes)
        # per entry: the offloader the region opened on (None: this one; _NOOP: none)
        self._host: list = []

    def __enter__(self) -> "TensorOffloader":
        if _in_backward():  # checkpoint recomputation: saves nothing here, and hooks of ours
            self._host.append(_NOOP)  # would hide its tensors from the checkpoint's own
            return self
        active = active_offloader()  # the calling thread's
        if active is not None and active is not self:
            if not self._own_store and self._store is not active.store:
                raise ValueError("offload_tensors: an offload context with another store is "
                                 "active, and the region would use that one; drop store=..., "
                                 "or pass the active context's store")
            active._open_region()  # its store and prefetch serve the region
            self._host.append(active)
            return self
        if _foreign_hooks_active():  # e.g. inside torch.utils.checkpoint: it decides what is
            self._host.append(_NOOP)  # saved (nothing, there); our hooks would hide its tensors
            return self
        super().__enter__()
        self._open_region()
        self._host.append(None)
        return self

    def __exit__(self, *exc: object) -> None:
        host = self._host.pop() if self._host else None
        if host is _NOOP:
            return
        if host is not None:
            host._close_region()
            return
        self._close_region()
        super().__exit__(*exc)


def offload_tensors(*, store: TierStore | None = None, tier: str = _D["tier"],
                    prefetch_depth: int = _D["prefetch_depth"],
                    min_offload_bytes: int = _D["min_offload_bytes"]) -> TensorOffloader:
    """Offload every tensor autograd saves inside the returned context (a region).

    Inside an active :func:`~tiermem.offload.offload_activations` context the region uses that
    context's store and prefetch and its arguments here must be left at their defaults; alone
    it installs its own hooks. Make it once and enter it every forward: its private store
    (when ``store`` is None) lives as long as it does.

    Args:
        store: the :class:`~tiermem.TierStore` to use alone; None makes a private one.
        tier: ``"cpu"`` (pinned host memory) or ``"nvme"`` (needs a store with an nvme budget).
        prefetch_depth: regions reloaded ahead of the one backward is in (>= 1).
        min_offload_bytes: saved tensors smaller than this many bytes stay on the device.

    Returns:
        a reusable :class:`TensorOffloader`.

    Raises:
        ValueError: unknown ``tier``, ``tier="nvme"`` without an nvme budget,
            ``prefetch_depth`` < 1, ``min_offload_bytes`` < 0; on entry, a ``store`` other
            than the active context's.
        TypeError: ``store`` is not a TierStore.
    """
    return TensorOffloader(store=store, tier=tier, prefetch_depth=prefetch_depth,
                           min_offload_bytes=min_offload_bytes)


def mark_for_offload(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` to be offloaded when autograd saves it (or a view of it) under an
    offload context, even inside a block the context keeps; returns it (sets
    ``tensor.activation_offloading`` and remembers its storage while it lives).

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"mark_for_offload: expected a torch.Tensor, got {type(tensor).__name__}")
    setattr(tensor, MARK, True)
    mark_storage(tensor)  # views of it that an op saves count too
    return tensor


class ModuleRegions:
    """What :func:`offload_in_modules` returns: its region (``.region``), the forward hooks
    that enter and leave it around each module's call, ``stats()`` and ``close()``."""

    def __init__(self, modules: list[nn.Module], region: TensorOffloader) -> None:
        self.region = region
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            # always_call: a forward that raises still leaves the region
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.region.__enter__()

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.region.__exit__(None, None, None)

    def stats(self) -> dict:
        """The region's offload counters (``ActivationOffloader.stats``); inside an
        ``offload_activations`` context its traffic is counted by that context instead.

        Raises:
            Nothing.
        """
        return self.region.stats()

    def close(self) -> None:
        """Remove the hooks (the modules run plainly again) and close the region.

        Raises:
            Nothing.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.region.close()


def offload_in_modules(modules: Iterable[nn.Module], *, store: TierStore | None = None,
                       tier: str = _D["tier"], prefetch_depth: int = _D["prefetch_depth"],
                       min_offload_bytes: int = _D["min_offload_bytes"]) -> ModuleRegions:
    """Offload every tensor autograd saves inside a call of any of ``modules``: one
    :func:`offload_tensors` region, entered by a forward pre-hook and left by an always-called
    forward hook of each module (nested calls nest). Alone it offloads nothing else; inside an
    active :func:`~tiermem.offload.offload_activations` context the region joins it (pass that
    context's store, or none). Call ``close()`` when done.

    Args:
        modules: the modules whose saved tensors go (e.g. a peft model's ``lora_A`` and
            ``lora_B`` Linears); at least one.
        store, tier, prefetch_depth, min_offload_bytes: as :func:`offload_tensors`.

    Returns:
        a :class:`ModuleRegions`.

    Raises:
        TypeError: an element of ``modules`` is not an ``nn.Module``; ``store`` is not a
            TierStore.
        ValueError: no module; what :func:`offload_tensors` refuses.
    """
    modules = list(modules)
    if not modules:
        raise ValueError("offload_in_modules: modules is empty; give the modules whose saved "
                         "tensors should be offloaded")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"offload_in_modules: expected nn.Module elements, got "
                            f"{type(m).__name__}")
    region = offload_tensors(store=store, tier=tier, prefetch_depth=prefetch_depth,
                             min_offload_bytes=min_offload_bytes)
    return ModuleRegions(modules, region)
