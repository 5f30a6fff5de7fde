"""Host memory pool: slabs of (pinned) memory, sub-allocated in 4096-byte aligned blocks.

Pinned allocation is slow (cudaHostAlloc ~0.5 s/GiB) and pins pages for good, so the pool
allocates slabs of ``slab_bytes`` once and reuses freed blocks; its total never exceeds
``capacity_bytes`` (the ``"cpu"`` tier budget). Blocks are 4096-byte aligned and their sizes
rounded up to 4096, so they can be handed to O_DIRECT I/O as they are.

Note [slab tail]: blocks of one size fill most of the pool (HybridAdam's chunk state: 48 MiB for
4M elements with fp32 moments), and a slab that is not a multiple of that size keeps a tail no
such block fits: 16 MiB of every 1 GiB slab. The 13B NVMe preset's 80 GiB pool, replayed without
memory (its rings, the NVMe staging, then 48 MiB chunks until full), held 1,673 chunks (the H200
run at c0c5ed4: 1,674) where whole slabs hold 1,699, as tiermem.apps.plan counts: 1.2 GiB more read
and written on NVMe every step than planned. So a new slab is cut to the largest multiple of the
request that opens it (``slab_bytes`` rounded down; a larger request still gets a slab of its
own size), and only the last slab, cut to what the capacity has left, may keep a tail.

Note [slabs outside inference mode]: a slab lives as long as the pool, but the request that
opens it may come under the caller's ``torch.inference_mode()`` (a weight stream reading
``tier="nvme"`` weights up for an evaluation's forward). A tensor made there is an inference
tensor, and every later in-place write into its blocks outside inference mode (the next
``put``, a training step's copy) raised "Inplace update to inference tensor outside
InferenceMode": training could not go on after such an evaluation. Slabs are therefore
allocated with inference mode off (an allocation records no autograd graph either way). The
store's device buffers (``Copier.alloc_device``) are left as they are: a ``put`` under inference
mode and more ``put``s after it into the gpu tier did not fail (each makes a buffer of its own).
tests/stream/test_stream_corners.py.
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


class _Slab:
    """One contiguous host allocation and the allocator of its free runs."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        with torch.inference_mode(False):  # Note [slabs outside inference mode]
            if pin:
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # aligned
            else:
                raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
                skip = (-raw.data_ptr()) % ALIGN_BYTES
                self.tensor = raw[skip:skip + nbytes]
        self.nbytes = nbytes
        self.allocator = ExtentAllocator(nbytes, align=ALIGN_BYTES)


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
        capacity_bytes: hard limit on the slabs the pool holds, in bytes.
        slab_bytes: size of one slab in bytes (a larger request gets a slab of its own size).
        pin: page-lock the slabs (needs CUDA).
    """

    def __init__(self, capacity_bytes: int, slab_bytes: int, pin: bool) -> None:
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = block_bytes(slab_bytes)
        self.pin = pin
        self._slabs: list[_Slab] = []
        self.used_bytes = 0
        """Bytes in live blocks (rounded sizes)."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes of slabs the pool holds (pinned pages when ``pin``)."""
        return sum(s.nbytes for s in self._slabs)

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
        room = self.capacity_bytes - self.reserved_bytes
        if room < alloc_bytes:
            self.trim()  # give empty slabs back so one slab big enough can take their place
            room = self.capacity_bytes - self.reserved_bytes
            if room < alloc_bytes:
                return None  # fragmented: the caller must free blocks
        # Note [slab tail]: a slab is a whole number of blocks of the size that opens it
        slab = (self.slab_bytes // alloc_bytes * alloc_bytes if alloc_bytes <= self.slab_bytes
                else alloc_bytes)
        self._slabs.append(_Slab(min(room, slab), self.pin))
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
        """Release slabs with no live block; return the bytes released."""
        empty = [s for s in self._slabs if s.allocator.used_bytes == 0]
        self._slabs = [s for s in self._slabs if s.allocator.used_bytes != 0]
        return sum(s.nbytes for s in empty)

    def close(self) -> None:
        """Drop every slab (blocks handed out become invalid)."""
        self._slabs.clear()
        self.used_bytes = 0
