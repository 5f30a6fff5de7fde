"""A first-fit, coalescing allocator of aligned byte ranges ("extents") in ``[0, capacity)``.

Used for spill-file extents (:mod:`tiermem.store.nvme`) and for sub-allocating host-pool slabs.
It only does the bookkeeping: no memory or file is touched. Not thread-safe: callers hold their
own lock around every call.

Free space is kept as sorted runs ``(start, nbytes)``: a list of run starts sorted by address
(for coalescing on free, found with :mod:`bisect`) and a list of ``(nbytes, start)`` sorted by
size (for the largest free run and for best fit). Searches are O(log n) in the number of free
runs (first fit scans runs in address order but skips the scan when no run is big enough);
inserts and removals are ``list`` memmoves, fast up to hundreds of thousands of runs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Literal


def round_up(nbytes: int, align: int) -> int:
    """Return ``nbytes`` rounded up to a multiple of ``align`` (bytes; ``align`` > 0)."""
    return -(-nbytes // align) * align


class ExtentAllocator:
    """Allocate ``align``-aligned byte ranges inside ``[0, capacity_bytes)``.

    Args:
        capacity_bytes: size of the managed space in bytes; rounded down to ``align``.
        align: alignment and size granularity of every extent in bytes (default 4096, the
            O_DIRECT and page granularity).
        fit: ``"first"`` (lowest address that fits; keeps a spill file compact and sequential)
            or ``"best"`` (smallest run that fits, O(log n)).

    Raises:
        ValueError: negative capacity, non-positive alignment or an unknown ``fit``.
    """

    def __init__(self, capacity_bytes: int, align: int = 4096,
                 fit: Literal["first", "best"] = "first") -> None:
        if not isinstance(align, int) or align <= 0:
            raise ValueError(f"ExtentAllocator align={align!r} must be a positive int (bytes)")
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"ExtentAllocator capacity_bytes={capacity_bytes!r} must be an "
                             f"int >= 0")
        if fit not in ("first", "best"):
            raise ValueError(f"ExtentAllocator fit={fit!r} is not 'first' or 'best'")
        self._align = align
        self._fit = fit
        self._capacity_bytes = capacity_bytes // align * align
        self._starts: list[int] = []              # free run starts, ascending
        self._size_at: dict[int, int] = {}        # free run start -> nbytes
        self._by_size: list[tuple[int, int]] = []  # (nbytes, start), ascending
        self._allocated: dict[int, int] = {}      # allocated start -> nbytes
        self._used_bytes = 0
        if self._capacity_bytes:
            self._add_run(0, self._capacity_bytes)

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Managed bytes (the constructor's capacity rounded down to ``align``)."""
        return self._capacity_bytes

    @property
    def align(self) -> int:
        """Alignment and size granularity of extents, bytes."""
        return self._align

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (sizes rounded up to ``align``)."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """``capacity_bytes - used_bytes``."""
        return self._capacity_bytes - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Size of the largest free run in bytes: the biggest request that can succeed now."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_allocated(self) -> int:
        """Number of extents currently allocated."""
        return len(self._allocated)

    def free_runs(self) -> list[tuple[int, int]]:
        """Return the free runs as ``(offset, nbytes)`` pairs in address order (for tests/stats)."""
        return [(s, self._size_at[s]) for s in self._starts]

    def is_allocated(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + round_up(nbytes))`` is exactly one allocated extent."""
        return self._allocated.get(offset) == round_up(nbytes, self._align)

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`alloc` of ``nbytes`` would succeed now."""
        return round_up(max(nbytes, 1), self._align) <= self.largest_free_bytes

    # -- updates ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int | None:
        """Allocate an extent of ``round_up(nbytes, align)`` bytes (at least ``align``).

        Returns:
            The extent's byte offset (a multiple of ``align``), or ``None`` when no free run is
            large enough (the allocator is unchanged).

        Raises:
            ValueError: ``nbytes`` is negative or not an int.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"ExtentAllocator.alloc nbytes={nbytes!r} must be an int >= 0")
        size = round_up(max(nbytes, 1), self._align)
        if size > self.largest_free_bytes:
            return None
        if self._fit == "best":
            run_size, start = self._by_size[bisect_left(self._by_size, (size, -1))]
        else:
            start = next(s for s in self._starts if self._size_at[s] >= size)
            run_size = self._size_at[start]
        self._remove_run(start)
        if run_size > size:
            self._add_run(start + size, run_size - size)
        self._allocated[start] = size
        self._used_bytes += size
        return start

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent at ``offset`` (``nbytes`` as passed to :meth:`alloc`); coalesces
        it with free neighbours.

        Raises:
            ValueError: ``offset``/``nbytes`` is not an allocated extent (double free, wrong size,
                or never allocated); the allocator is unchanged.
        """
        size = round_up(max(nbytes, 1), self._align)
        if self._allocated.get(offset) != size:
            raise ValueError(
                f"ExtentAllocator.free(offset={offset}, nbytes={nbytes}): not an allocated extent "
                f"(allocated size there: {self._allocated.get(offset)}); double free or wrong size")
        del self._allocated[offset]
        self._used_bytes -= size
        start, end = offset, offset + size
        i = bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == end:       # merge with the next run
            end += self._size_at[end]
            self._remove_run(self._starts[i])
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._size_at[prev] == start:                 # merge with the previous run
                start = prev
                self._remove_run(prev)
        self._add_run(start, end - start)

    def _add_run(self, start: int, nbytes: int) -> None:
        insort(self._starts, start)
        self._size_at[start] = nbytes
        insort(self._by_size, (nbytes, start))

    def _remove_run(self, start: int) -> None:
        nbytes = self._size_at.pop(start)
        del self._starts[bisect_left(self._starts, start)]
        del self._by_size[bisect_left(self._by_size, (nbytes, start))]

    def __repr__(self) -> str:
        return (f"ExtentAllocator(capacity_bytes={self._capacity_bytes}, used_bytes="
                f"{self._used_bytes}, free_runs={len(self._starts)}, "
                f"largest_free_bytes={self.largest_free_bytes})")
