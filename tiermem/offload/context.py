"""The offload context entered on each thread, and whether autograd's engine is running (the
pack hook keeps what is saved during backward; block hooks change no state then)."""

from __future__ import annotations

import threading

import torch

# the offloader entered on each thread: saved-tensor hooks are per thread, so each thread may
# train its own model under its own context (one per thread: nesting is refused)
_ACTIVE = threading.local()


def active_offloader() -> "ActivationOffloader | None":
    """The offload context entered on the calling thread, if any (an
    :class:`tiermem.offload.activations.ActivationOffloader`, which sets it)."""
    return getattr(_ACTIVE, "offloader", None)


def _in_backward() -> bool:
    """True while the autograd engine is executing (recomputation, hooks, double backward)."""
    return torch._C._current_graph_task_id() != -1
