"""The tensor a rank steps of a param: the param itself, or an FSDP2 DTensor's local shard.

Kept apart from :mod:`tiermem.optim.distributed` so that a single-process run (which only asks
"is this a DTensor?" and always gets "no") never imports the distributed code.
"""

from __future__ import annotations

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2 params and grads).

    Raises:
        Nothing.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a detached view sharing its storage), or ``t`` detached.

    Raises:
        Nothing.
    """
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()
    return t.detach()
