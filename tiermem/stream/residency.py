"""Which streamed blocks stay resident on the device under a byte budget: a pure function of
the blocks' sizes, the budget and the prefetch depth (Note [resident blocks]).

Note [resident blocks]: backward visits the blocks last to first, so the last blocks are the
ones whose weights are needed again soonest after the forward (their backward follows their
forward with the least in between). Keeping a suffix of the blocks resident saves both of their
transfers per pass and removes the stall at the start of the backward. The rule: the streaming
buffers come first (a streamed block needs up to ``prefetch_blocks + 2`` blocks' weights on the
device at once: the block computing, the one after it whose gradients are still being
accumulated in the backward, and ``prefetch_blocks`` in flight, each counted at the largest
streamed block's size). The resident set is the longest suffix of the
blocks whose bytes plus the buffers that the other (streamed) blocks need fit ``gpu_bytes``.
That cost is not monotone in the suffix (making a large block resident can shrink the buffers
of the rest), so every suffix is tried, longest first, rather than stopping at the first block
that does not fit. With every block resident no buffer is
needed. ``gpu_bytes=None`` streams every block.

Note [kept into backward]: the last streamed blocks the forward runs are the first ones the
backward needs; releasing them after their forward only to fetch them again at the start of the
backward costs their bytes twice and a stall (the first backward fill can overlap nothing: it
waits for the head's backward, and the block's backward waits for it). So the forward keeps the
last ``kept`` streamed blocks on the device into the backward (``ResidencyPlan.kept``): at most
``buffer_blocks`` of them (``prefetch_blocks + 2``), so the device never holds more streamed
blocks than the buffers the plan counted (in the forward at most ``max(kept, prefetch + 1)``,
in the backward at most ``prefetch + 2``, as without keeping). Each pass that has a backward
then fetches ``2 * streamed - kept`` blocks (block-major: per step; depth-first: per
micro-batch). A forward without a backward (under ``no_grad``, or outputs dropped) keeps
nothing: its blocks are released as before (depth-first), or when the pass ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tiermem.names import check_int


@dataclass(frozen=True)
class ResidencyPlan:
    """What :func:`plan_residency` decided."""

    resident: tuple[int, ...]
    """Indices of the blocks kept on the device (a suffix of the blocks, ascending)."""
    streamed: tuple[int, ...]
    """Indices of the streamed blocks, ascending."""
    resident_bytes: int
    """Bytes of the resident blocks' weights."""
    buffer_bytes: int
    """Bytes of the streaming buffers (at most ``buffer_blocks`` blocks of the largest streamed
    block; 0 when nothing streams)."""
    buffer_blocks: int
    """Streamed blocks whose weights may be on the device at once."""
    kept: tuple[int, ...] = ()
    """The last streamed blocks, which a forward leaves on the device for its backward (Note
    [kept into backward]; ascending, at most ``buffer_blocks`` of them)."""

    @property
    def device_bytes(self) -> int:
        """Bytes of the weights of these blocks on the device at the peak."""
        return self.resident_bytes + self.buffer_bytes


def buffer_blocks_for(prefetch_blocks: int, n_streamed: int) -> int:
    """Streamed blocks on the device at once: ``prefetch_blocks + 2`` (Note [resident
    blocks]), at most ``n_streamed``.

    Raises:
        nothing: arithmetic on two ints.
    """
    return min(prefetch_blocks + 2, n_streamed)


def kept_blocks_for(streamed: Sequence[int], buffer_blocks: int) -> tuple[int, ...]:
    """The streamed blocks a forward keeps on the device for its backward: the last
    ``buffer_blocks`` of ``streamed`` (Note [kept into backward]).

    Raises:
        nothing: a slice.
    """
    return tuple(sorted(streamed))[len(streamed) - buffer_blocks:] if buffer_blocks > 0 else ()


def plan_residency(block_bytes: Sequence[int], *, gpu_bytes: int | None,
                   prefetch_blocks: int) -> ResidencyPlan:
    """Decide which blocks stay resident (Note [resident blocks]).

    Args:
        block_bytes: bytes of each block's weights, in execution order.
        gpu_bytes: device bytes the weights of these blocks may use (resident blocks plus the
            streaming buffers); None: stream every block.
        prefetch_blocks: blocks whose weights are fetched ahead of their use (>= 0).

    Returns:
        The :class:`ResidencyPlan`.

    Raises:
        TypeError: a size, ``gpu_bytes`` or ``prefetch_blocks`` that is not an int.
        ValueError: a negative size or depth, or ``gpu_bytes`` smaller than the streaming
            buffers (the message gives the least budget that works).
    """
    who = "plan_residency: "
    sizes = [check_int(who, f"block_bytes[{i}]", b, low=0, unit="bytes")
             for i, b in enumerate(block_bytes)]
    check_int(who, "prefetch_blocks", prefetch_blocks, low=0, unit="blocks")
    n = len(sizes)
    if gpu_bytes is None:
        return _plan(sizes, n, prefetch_blocks)
    check_int(who, "gpu_bytes", gpu_bytes, low=0, unit="bytes")
    plans = [_plan(sizes, first, prefetch_blocks) for first in range(n + 1)]
    for plan in plans:  # the longest resident suffix first
        if plan.device_bytes <= gpu_bytes:
            return plan
    least = min(plans, key=lambda p: p.device_bytes)
    raise ValueError(f"{who}gpu_bytes={gpu_bytes} cannot hold these blocks' weights: streaming "
                     f"every block needs {plans[-1].buffer_blocks} buffers x {max(sizes)} "
                     f"bytes (the largest block) = {plans[-1].buffer_bytes} bytes, and the "
                     f"cheapest plan {least.device_bytes} bytes ({len(least.resident)} blocks "
                     f"resident); raise gpu_bytes to at least {least.device_bytes}, lower "
                     f"prefetch_blocks, or pass gpu_bytes=None")


def _plan(sizes: list[int], first_resident: int, prefetch_blocks: int) -> ResidencyPlan:
    """The plan that streams blocks ``0 .. first_resident - 1`` and keeps the rest."""
    streamed = tuple(range(first_resident))
    resident = tuple(range(first_resident, len(sizes)))
    n_buffers = buffer_blocks_for(prefetch_blocks, len(streamed))
    largest = max((sizes[i] for i in streamed), default=0)
    return ResidencyPlan(resident=resident, streamed=streamed,
                         resident_bytes=sum(sizes[i] for i in resident),
                         buffer_bytes=n_buffers * largest, buffer_blocks=n_buffers,
                         kept=kept_blocks_for(streamed, n_buffers))
