"""Which blocks' activations to offload: the ones whose transfers fit under the compute.

Activation offload pays off only where its copies hide behind compute: in forward, block ``i``'s
saved tensors go D2H while the blocks after it run, and must be off the device by the end of
forward (or the memory they hold is still there at the peak); in backward, block ``i``'s reload
is issued when backward enters the offloaded block after it (or at the start of backward, for
the last ``prefetch_depth`` offloaded blocks, as :class:`tiermem.offload.rules.LayerPolicy`
prefetches) and must have landed when backward reaches block ``i``, or backward stalls.

:func:`simulate` replays one step of that pipeline from measured per-block times and bytes
(one D2H and one H2D stream, each copying at its bandwidth, in order). On a GPU the host issues
the work and the device runs it: when block costs carry host times (the block's own Python and
launches, and the extra host work of offloading it: store puts, copy issue), the forward also
runs a host clock, a block's kernels cannot finish before the host has issued them, and what
offloading adds to the forward's end on the device is a stall like a late copy (from a standing
start: the host is not assumed ahead of the device when forward begins). :func:`choose_layers`
adds blocks in forward order -- the first blocks' reloads have the most backward compute to
hide behind -- keeping each one whose addition leaves the step without a stall, then, if
``max_kept_bytes`` is given, offloads more blocks (least added stall first) until what stays on
the device fits. Pure functions of numbers: testable anywhere.

Units: seconds, bytes, bytes per second.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockCosts:
    """Measured costs of each block of a stack, in forward order.

    Attributes:
        fwd_s: forward compute seconds per block.
        bwd_s: backward compute seconds per block (commonly ~2x forward).
        nbytes: bytes of saved activations the block would offload.
        host_s: host seconds to issue the block's forward (its Python and kernel launches);
            empty: no host clock (the CPU, where the host computes the blocks itself).
        offload_host_s: extra host seconds when the block is offloaded (its store puts and
            copy issue); empty: none.
    """

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    nbytes: tuple[int, ...]
    host_s: tuple[float, ...] = ()
    offload_host_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        if not n or len(self.bwd_s) != n or len(self.nbytes) != n:
            raise ValueError(f"BlockCosts: fwd_s, bwd_s and nbytes must have one entry per block "
                             f"(got {len(self.fwd_s)}, {len(self.bwd_s)}, {len(self.nbytes)})")
        for name in ("host_s", "offload_host_s"):
            if len(getattr(self, name)) not in (0, n):
                raise ValueError(f"BlockCosts: {name} must be empty or have one entry per block "
                                 f"(got {len(getattr(self, name))} for {n} blocks)")
        for name in ("fwd_s", "bwd_s", "nbytes", "host_s", "offload_host_s"):
            for i, x in enumerate(getattr(self, name)):
                if not (isinstance(x, (int, float)) and x >= 0 and math.isfinite(x)):
                    raise ValueError(f"BlockCosts.{name}[{i}]={x!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` predicts for one step.

    Attributes:
        forward_s: when forward ends on the device: the sum of ``fwd_s``, or later where the
            host could not issue the blocks in time.
        late_s: how long after the end of forward the last D2H copy ends (0: all hidden).
        stall_s: total time backward waits for reloads.
        kept_bytes: activation bytes of the blocks that are not offloaded.
        host_stall_s: how much later forward ends on the device than with nothing offloaded,
            because of the offloaded blocks' host work (0 without host times).
    """

    forward_s: float
    late_s: float
    stall_s: float
    kept_bytes: int
    host_stall_s: float = 0.0

    @property
    def hidden(self) -> bool:
        """True when every copy, and the host work of issuing it, hides behind compute (no late
        D2H, no backward stall, no host delay to forward)."""
        return self.late_s <= 1e-12 and self.stall_s <= 1e-12 and self.host_stall_s <= 1e-12


def simulate(costs: BlockCosts, layers: Sequence[int] | frozenset[int], d2h_bytes_per_s: float,
             h2d_bytes_per_s: float, prefetch_depth: int = 1) -> Timeline:
    """Replay one step with ``layers`` offloaded (see the module docstring).

    Raises:
        ValueError: a bandwidth that is not positive, ``prefetch_depth`` < 1, a layer index
            outside the stack.
    """
    n = len(costs.fwd_s)
    if not (d2h_bytes_per_s > 0 and h2d_bytes_per_s > 0):
        raise ValueError(f"simulate: bandwidths must be > 0 bytes/s (d2h={d2h_bytes_per_s!r}, "
                         f"h2d={h2d_bytes_per_s!r})")
    if prefetch_depth < 1:
        raise ValueError(f"simulate: prefetch_depth={prefetch_depth} must be >= 1")
    order = sorted(set(layers))
    if order and not (0 <= order[0] and order[-1] < n):
        raise ValueError(f"simulate: layers {order} must be block indices in [0, {n})")
    # forward: each offloaded block's copy starts when the block ends and the stream is free
    offloaded = set(order)
    ends = _forward_ends(costs, offloaded)
    d2h_free = 0.0
    for i in order:
        d2h_free = max(d2h_free, ends[i]) + costs.nbytes[i] / d2h_bytes_per_s
    forward_s = ends[-1]
    host_stall = max(0.0, forward_s - _forward_ends(costs, set())[-1]) if order else 0.0
    late = max(0.0, d2h_free - forward_s)
    # backward: reload of order[k] is issued when backward enters order[k + depth]
    t = forward_s + late  # a reload cannot start before its copy is off the device
    issue_at: dict[int, list[int]] = {}  # block backward enters -> reloads it issues
    first = order[-prefetch_depth:]
    for k, b in enumerate(order[:len(order) - len(first)]):
        issue_at.setdefault(order[k + prefetch_depth], []).append(b)
    h2d_free, ready, stall = t, {}, 0.0
    for b in reversed(first):  # issued at the start of backward, nearest first
        h2d_free = max(h2d_free, t) + costs.nbytes[b] / h2d_bytes_per_s
        ready[b] = h2d_free
    for i in range(n - 1, -1, -1):
        if i in offloaded:
            wait = max(0.0, ready[i] - t)
            stall += wait
            t += wait
        for b in issue_at.get(i, ()):  # entering block i prefetches the ones before it
            h2d_free = max(h2d_free, t) + costs.nbytes[b] / h2d_bytes_per_s
            ready[b] = h2d_free
        t += costs.bwd_s[i]
    kept = sum(costs.nbytes[i] for i in range(n) if i not in offloaded)
    return Timeline(forward_s, late, stall, kept, host_stall)


def _forward_ends(costs: BlockCosts, offloaded: set[int]) -> list[float]:
    """When each block's forward ends on the device: after the block before it and its own
    compute, and not before the host has issued it (``host_s``, plus ``offload_host_s`` for an
    offloaded block; a host clock only where the costs carry host times)."""
    n = len(costs.fwd_s)
    host_s = costs.host_s or (0.0,) * n
    extra = costs.offload_host_s or (0.0,) * n
    host = device = 0.0
    ends = []
    for i in range(n):
        host += host_s[i] + (extra[i] if i in offloaded else 0.0)
        device = max(device + costs.fwd_s[i], host)
        ends.append(device)
    return ends


def choose_layers(costs: BlockCosts, d2h_bytes_per_s: float, h2d_bytes_per_s: float,
                  prefetch_depth: int = 1, max_kept_bytes: int | None = None) -> frozenset[int]:
    """The blocks to offload: as many as hide behind compute, then more if memory demands.

    Args:
        costs: measured per-block costs.
        d2h_bytes_per_s: device -> host copy bandwidth.
        h2d_bytes_per_s: host -> device copy bandwidth.
        prefetch_depth: offloaded blocks reloaded ahead of the one backward is in.
        max_kept_bytes: at most this many activation bytes may stay on the device (None: no
            bound); beyond the hidden set, blocks are added least added stall first until it
            holds (if even offloading every block cannot meet it, every block is offloaded).

    Returns:
        the offloaded block indices.

    Raises:
        ValueError: as :func:`simulate`, or ``max_kept_bytes`` < 0.
    """
    if max_kept_bytes is not None and max_kept_bytes < 0:
        raise ValueError(f"choose_layers: max_kept_bytes={max_kept_bytes} must be >= 0 bytes")
    n = len(costs.fwd_s)

    def sim(layers: set[int]) -> Timeline:
        return simulate(costs, frozenset(layers), d2h_bytes_per_s, h2d_bytes_per_s,
                        prefetch_depth)

    chosen: set[int] = set()
    for i in range(n):
        if costs.nbytes[i] and sim(chosen | {i}).hidden:
            chosen.add(i)
    if max_kept_bytes is None:
        return frozenset(chosen)
    kept = sim(chosen).kept_bytes
    while kept > max_kept_bytes:
        rest = [i for i in range(n) if i not in chosen and costs.nbytes[i]]
        if not rest:
            break
        def cost(i: int) -> tuple[float, int]:
            t = sim(chosen | {i})  # least extra time first, the larger block on a tie
            return t.late_s + t.stall_s + t.host_stall_s, -costs.nbytes[i]

        best = min(rest, key=cost)
        chosen.add(best)
        kept -= costs.nbytes[best]
    return frozenset(chosen)


def kept_budget_bytes(nbytes: Sequence[int], offloaded: Sequence[int] | frozenset[int],
                      total_bytes: int, peak_bytes: int, room_fraction: float = 0.8) -> int:
    """The activation bytes ``layers="auto"`` lets stay on the device by default (CUDA).

    The timed forward's peak (``peak_bytes``, e.g. ``torch.cuda.max_memory_allocated``)
    already holds the blocks it kept, not the ones it ``offloaded``: the budget is those
    kept blocks' ``nbytes`` plus ``room_fraction`` of the memory still unused
    (``total_bytes - peak_bytes``, none if negative). Counting the offloaded blocks' bytes too
    would grant room the device does not have.

    Raises:
        ValueError: a negative byte count, ``room_fraction`` outside ``[0, 1]``, an
            ``offloaded`` index outside ``nbytes``.
    """
    if not 0.0 <= room_fraction <= 1.0:
        raise ValueError(f"kept_budget_bytes: room_fraction={room_fraction!r} must be in [0, 1]")
    if min(total_bytes, peak_bytes, *nbytes, 0) < 0:
        raise ValueError(f"kept_budget_bytes: byte counts must be >= 0 (total_bytes="
                         f"{total_bytes}, peak_bytes={peak_bytes}, nbytes={list(nbytes)})")
    gone = set(offloaded)
    if gone and not (min(gone) >= 0 and max(gone) < len(nbytes)):
        raise ValueError(f"kept_budget_bytes: offloaded={sorted(gone)} must be block indices in "
                         f"[0, {len(nbytes)})")
    kept = sum(n for i, n in enumerate(nbytes) if i not in gone)
    return kept + int(room_fraction * max(0, total_bytes - peak_bytes))


def best_time_s(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn`` after one untimed warm-up, in seconds
    (at least 1 ns)."""
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def copy_bandwidths(device: torch.device, nbytes: int = 64 << 20, repeat: int = 3
                    ) -> tuple[float, float]:
    """Measure ``(d2h, h2d)`` copy bandwidth in bytes/s between ``device`` and pinned host
    memory (a host copy without CUDA), best of ``repeat`` after a warm-up.

    Raises:
        ValueError: ``nbytes`` < 1 or ``repeat`` < 1.
    """
    if nbytes < 1 or repeat < 1:
        raise ValueError(f"copy_bandwidths: nbytes={nbytes} and repeat={repeat} must be >= 1")
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(device)  # the copy is done (and the next starts idle)

    return (nbytes / best_time_s(lambda: copy(host, dev), repeat),
            nbytes / best_time_s(lambda: copy(dev, host), repeat))


def disk_bandwidths(directory: str | None, nbytes: int = 32 << 20, repeat: int = 2
                    ) -> tuple[float, float]:
    """Measure ``(write, read)`` bandwidth in bytes/s of a file in ``directory`` (None: a
    temporary directory): best of ``repeat`` after a warm-up; each write is fsync'd and the
    file's pages are dropped from the page cache before each read, so both hit the disk.

    Raises:
        ValueError: ``nbytes`` < 1 or ``repeat`` < 1.
        OSError: ``directory`` is not writable.
    """
    if nbytes < 1 or repeat < 1:
        raise ValueError(f"disk_bandwidths: nbytes={nbytes} and repeat={repeat} must be >= 1")
    data = os.urandom(nbytes)
    buf = bytearray(nbytes)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = os.path.join(tmp, "bw")

        def write() -> None:
            with open(path, "wb", buffering=0) as f:
                f.write(data)
                os.fsync(f.fileno())  # on the disk, not in the page cache

        def read() -> None:
            with open(path, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):  # drop the cached pages: read the disk
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                f.readinto(buf)

        return nbytes / best_time_s(write, repeat), nbytes / best_time_s(read, repeat)
