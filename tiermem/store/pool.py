"""Host memory pool: slabs of (pinned) memory, sub-allocated in 4096-byte aligned blocks.

Pinned allocation is slow (cudaHostAlloc ~0.5 s/GiB) and pins pages for good, so the pool
allocates slabs once and reuses freed blocks; the bytes its slabs pin never exceed
``capacity_bytes`` (the ``"cpu"`` tier budget). Blocks are 4096-byte aligned and their sizes
rounded up to 4096, so they can be handed to O_DIRECT I/O as they are.

Note [slab tail]: blocks of one size fill most of the pool (HybridAdam's chunk state: 48 MiB for
4M elements with fp32 moments, 128 MiB for 16M with bf16 moments), and where a slab ends no
such block fits it keeps a tail. How a new slab is cut (:func:`slab_cut`, the pool's only
sizing decision) depends on what the slab costs:

- Pinned (``pin``): torch's pinned allocator pins the next power of two of every request
  (Note [pinned rounding] in tiermem/apps/plan/pinned.py). Slabs cut to whole 48 MiB blocks
  (1008 MiB) each pinned 1 GiB, and the last one, cut to what the capacity had left, the next
  power of two of that: the 13B stream preset's 88 GiB store pinned ~89 GiB on the H200, part
  of what got the run OOM-killed. So a pinned slab is a power of two, and the capacity counts
  exactly what it pins: ``slab_bytes`` rounded down to a power of two; a larger request the
  next power of two of its size (only if the room left holds it: else the request is refused,
  ``None``); and where the room left is smaller, the largest power of two in it. A remainder
  that is a multiple of 4096 thus decomposes into slabs that pin nothing beyond the budget.
  The tail costs chunks: a 1 GiB slab holds 21 chunks of 48 MiB and a 16 MiB tail, which serves
  smaller blocks (every allocation tries every slab first); 80 GiB of 48 MiB chunks alone are
  1,680 of them, not the 1,706 the bytes would say. :func:`pool_blocks` counts that, and the
  plan counts the state's RAM chunks with it (tiermem.apps.plan.placement). Chunks of a power of
  two (bf16 moments with 4M or 16M elements: 32 or 128 MiB) leave no tail. So a pinned store
  sized by the bytes it will hold (plus a slab) can be short: :func:`pool_room_for` replays a
  known list of blocks and gives the capacity that holds them (the 13B GPT's streamed weights,
  16.41 GiB of pages: 17 GiB of 1 GiB slabs, 21.1 GiB of slabs of its largest weight).
- Pageable (``not pin``, CPU runs): a slab costs its bytes, so a new slab is cut to the largest
  multiple of the request that opens it (``slab_bytes`` rounded down; a larger request a slab
  of its own size), and only the last slab, cut to what the capacity has left, keeps a tail.
  1 GiB slabs kept 16 MiB no 48 MiB chunk fits: the 13B NVMe preset's 80 GiB pool held 1,673
  chunks (911f3e6) where whole slabs hold 1,699.

A dropped pinned slab (:meth:`HostPool.trim`, :meth:`HostPool.close`) goes back to torch's cache
of pinned blocks, still pinned, and a later slab of another size would be pinned beside it; so
the pool empties that cache after dropping slabs (:func:`_empty_host_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermem.store.extents import ExtentAllocator, round_up

ALIGN_BYTES = 4096


def block_bytes(nbytes: int) -> int:
    """The bytes a pool block (or a slab) of ``nbytes`` takes: whole ``ALIGN_BYTES`` pages, at
    least one."""
    return round_up(max(nbytes, 1), ALIGN_BYTES)


def pinned_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator pins for a request of ``nbytes``: the next
    power of two (Note [pinned rounding] in tiermem/apps/plan/pinned.py); 0 for 0.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"pinned_bytes(): nbytes={nbytes} is negative; fix: a byte count >= 0")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def _floor_pow2(nbytes: int) -> int:
    """The largest power of two <= ``nbytes`` (0 for 0)."""
    return 0 if nbytes <= 0 else 1 << (nbytes.bit_length() - 1)


def slab_cut(room_bytes: int, alloc_bytes: int, slab_bytes: int, pin: bool) -> int | None:
    """The bytes of the slab the pool opens for a block of ``alloc_bytes`` when its slabs
    leave ``room_bytes`` of the capacity (Note [slab tail]), or ``None``: no slab within the
    room holds the block. Pinned, the slab is a power of two (what torch pins for it), so the
    slabs pinned never exceed the capacity.

    Args:
        room_bytes: capacity left, in bytes (the capacity minus the slabs held).
        alloc_bytes: the block, in whole pages (:func:`block_bytes`).
        slab_bytes: the pool's slab size, in whole pages.
        pin: the slab is pinned (power-of-two cuts) or pageable (whole blocks).

    Raises:
        nothing: arithmetic on ints.
    """
    if alloc_bytes > room_bytes:
        return None
    if not pin:
        whole = (slab_bytes // alloc_bytes * alloc_bytes if alloc_bytes <= slab_bytes
                 else alloc_bytes)
        return min(room_bytes, whole)
    size = _floor_pow2(min(room_bytes, max(_floor_pow2(slab_bytes), pinned_bytes(alloc_bytes))))
    return size if size >= alloc_bytes else None


def pool_blocks(room_bytes: int, nbytes: int, slab_bytes: int, pin: bool = True) -> int:
    """How many blocks of ``nbytes`` a pool with ``room_bytes`` of capacity and no slab yet
    holds when they are all it allocates: the slabs :func:`slab_cut` opens, whole blocks each
    (Note [slab tail]); for the plan, which counts the optimizer state's RAM chunks so.

    Raises:
        nothing: arithmetic on ints.
    """
    alloc = block_bytes(nbytes)
    slab = block_bytes(slab_bytes)
    count = 0
    while (size := slab_cut(room_bytes, alloc, slab, pin)) is not None:
        count += size // alloc
        room_bytes -= size
    return count


def pool_room(count: int, nbytes: int, slab_bytes: int, pin: bool = True) -> int:
    """The capacity, in bytes, with which a pool holding nothing else holds ``count`` blocks
    of ``nbytes`` (whole slabs of them, then one slab for the rest: Note [slab tail]);
    ``pool_blocks(pool_room(n, b, s, pin), b, s, pin) >= n``.

    Raises:
        nothing: arithmetic on ints.
    """
    if count <= 0:
        return 0
    alloc = block_bytes(nbytes)
    slab = slab_cut(1 << 62, alloc, block_bytes(slab_bytes), pin)  # what an open room cuts
    per = slab // alloc
    full, rest = divmod(count, per)
    if not rest:
        return full * slab
    last = rest * alloc
    return full * slab + (pinned_bytes(last) if pin else last)


def pool_room_for(sizes: list[int], slab_bytes: int, pin: bool = True) -> int:
    """The capacity, in bytes, with which a fresh pool serves blocks of ``sizes`` allocated in
    that order (none freed): its slabs replayed without memory (:func:`slab_cut` with no
    limit, first fit over every slab), the last cut down to the power of two (pinned) or the
    pages its blocks reach, as a pool of that capacity cuts it (Note [slab tail]). For sizing
    a store that holds a known set of tensors (a model's weights, an optimizer's chunks).

    Raises:
        nothing: arithmetic on ints.
    """
    slab = block_bytes(slab_bytes)
    slabs: list[tuple[int, ExtentAllocator]] = []
    reach = 0  # the end of the last slab's highest block
    for nbytes in sizes:
        alloc = block_bytes(nbytes)
        for i, (_, extents) in enumerate(slabs):
            offset = extents.alloc(alloc)
            if offset is not None:
                if i == len(slabs) - 1:
                    reach = max(reach, offset + alloc)
                break
        else:
            size = slab_cut(1 << 62, alloc, slab, pin)
            slabs.append((size, ExtentAllocator(size, align=ALIGN_BYTES)))
            reach = slabs[-1][1].alloc(alloc) + alloc
    if not slabs:
        return 0
    last = pinned_bytes(reach) if pin else reach
    return sum(size for size, _ in slabs[:-1]) + last


def _host_tensor(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of page-aligned host memory as a uint8 tensor, pinned by torch when ``pin``
    (then ``nbytes`` must be a power of two for the capacity to count what is pinned)."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # page aligned
    raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[skip:skip + nbytes]


def _empty_host_cache() -> None:
    """Unpin the pinned blocks torch caches that nothing uses any more (Note [slab tail])."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is not None:
        empty()


class _Slab:
    """One contiguous host allocation and the allocator of its free runs."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.tensor = _host_tensor(nbytes, pin)
        self.nbytes = nbytes
        self.pinned_bytes = pinned_bytes(nbytes) if pin else 0
        """What torch pins for it (the capacity counts ``max(nbytes, pinned_bytes)``)."""
        self.allocator = ExtentAllocator(nbytes, align=ALIGN_BYTES)

    @property
    def held_bytes(self) -> int:
        """The bytes of host memory the slab takes: pinned, the power of two torch pins."""
        return max(self.nbytes, self.pinned_bytes)


@dataclass(eq=False)
class HostBlock:
    """A block of pool memory. ``tensor`` is a uint8 view of ``alloc_bytes`` bytes."""

    tensor: torch.Tensor
    nbytes: int
    alloc_bytes: int
    slab: _Slab
    offset: int


class HostPool:
    """A bounded pool of (pinned) host memory blocks. Not thread-safe: the store locks it.

    Args:
        capacity_bytes: hard limit on the host memory the slabs take (pinned: the bytes torch
            pins for them), in bytes.
        slab_bytes: size of one slab in bytes; pinned, rounded down to a power of two (a larger
            request gets a slab of its own: Note [slab tail]).
        pin: page-lock the slabs (needs CUDA).
    """

    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = block_bytes(slab_bytes)
        self.pin = pin
        self._slabs: list[_Slab] = []
        self.used_bytes = 0
        """Bytes in live blocks (rounded sizes)."""

    def capacity_for(self, nbytes: int) -> int:
        """The least ``capacity_bytes`` with which a block of ``nbytes`` can ever be served:
        its pages, or pinned the power of two of the smallest slab holding them (Note [slab
        tail]); a larger request waits forever (the store refuses it at once instead).

        Raises:
            nothing: arithmetic on ints.
        """
        alloc = block_bytes(nbytes)
        return pinned_bytes(alloc) if self.pin else alloc

    @property
    def reserved_bytes(self) -> int:
        """Bytes of host memory the slabs take (pinned pages when ``pin``), <= capacity."""
        return sum(s.held_bytes for s in self._slabs)

    def alloc(self, nbytes: int) -> HostBlock | None:
        """Return a block of at least ``nbytes`` bytes, or ``None`` if the pool cannot serve it
        without exceeding ``capacity_bytes`` (the caller then frees blocks and retries).

        Raises:
            RuntimeError: pinning failed (no CUDA or the OS refused).
        """
        alloc_bytes = block_bytes(nbytes)
        if self.used_bytes + alloc_bytes > self.capacity_bytes:
            return None
        block = self._alloc_in_slabs(nbytes, alloc_bytes)
        if block is not None:
            return block
        size = slab_cut(self.capacity_bytes - self.reserved_bytes, alloc_bytes,
                        self.slab_bytes, self.pin)
        if size is None:
            self.trim()  # give empty slabs back so one slab big enough can take their place
            size = slab_cut(self.capacity_bytes - self.reserved_bytes, alloc_bytes,
                            self.slab_bytes, self.pin)
            if size is None:
                return None  # fragmented: the caller must free blocks
        self._slabs.append(_Slab(size, self.pin))
        return self._alloc_in_slabs(nbytes, alloc_bytes)

    def _alloc_in_slabs(self, nbytes: int, alloc_bytes: int) -> HostBlock | None:
        for slab in self._slabs:
            offset = slab.allocator.alloc(alloc_bytes)
            if offset is not None:
                self.used_bytes += alloc_bytes
                view = slab.tensor[offset:offset + alloc_bytes]
                return HostBlock(view, nbytes, alloc_bytes, slab, offset)
        return None

    def free(self, block: HostBlock) -> None:
        """Return ``block`` to the pool. The caller guarantees no copy still uses it."""
        block.slab.allocator.free(block.offset, block.alloc_bytes)
        self.used_bytes -= block.alloc_bytes

    def trim(self) -> int:
        """Release slabs with no live block (pinned: unpinned, Note [slab tail]); return the
        bytes released.

        Raises:
            nothing.
        """
        empty = [s for s in self._slabs if s.allocator.used_bytes == 0]
        self._slabs = [s for s in self._slabs if s.allocator.used_bytes != 0]
        released = sum(s.held_bytes for s in empty)
        if empty and self.pin:
            empty.clear()  # the last references: torch caches the slabs, still pinned...
            _empty_host_cache()  # ...until its cache is emptied
        return released

    def close(self) -> None:
        """Drop every slab (blocks handed out become invalid); pinned ones are unpinned."""
        had = bool(self._slabs)
        self._slabs.clear()
        self.used_bytes = 0
        if had and self.pin:
            _empty_host_cache()
