"""Pinned host gradients of streamed weights: one exactly pinned slab per streamed block
(Note [host gradient slabs]).

Note [host gradient slabs]: on CUDA a streamed weight's gradient lands in a pinned host tensor
(Note [host gradients] in tiermem/stream/grads.py). One ``torch.empty(..., pin_memory=True)``
per weight pinned the next power of two of each (Note [exact pinning] in
tiermem/store/pinned.py: 22.8 GiB for the 13B stream plan's 16.4). So the host gradients of a
block's trainable weights are views of one slab, pinned for exactly its bytes and allocated when
the block's first gradient lands: the weights in the block's order, each at an offset rounded up
to ``GRAD_ALIGN_BYTES`` (64: a cache line), the slab whole 4 KiB pages (:func:`block_grad_bytes`,
what tiermem.apps.plan counts). The staging tensors of later micro-batches (depth-first over
several micro-batches) get a second slab of the same layout. Each weight owns its region for
the stream's life, so a step reuses the pinned pages of the step before, as torch's cache did.

The host gradient is handed out as ``param.grad`` and lives as long as the program keeps it,
as with torch's allocator: the region is a tensor of its own storage (``torch.frombuffer`` over
the slab's memory), so ``zero_grad(set_to_none=True)`` (or dropping every view of it) frees the
region, and the next step's gradient takes it again. A weight whose region is still held (a
program kept an old gradient) or that was not trainable when its block's slab was laid out gets
a tensor of torch's pinned allocator instead (counted in ``fallbacks``; logged once), so no
value anyone holds is overwritten. :meth:`GradSlabs.close` (the stream's close) unpins the
slabs; a region still held stays valid (unpinned) until it is dropped.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import torch

from tiermem._log import logger
from tiermem.store.extents import round_up
from tiermem.store.pinned import Pinner, PinnedBuffer, default_pinner, pinned_bytes

GRAD_ALIGN_BYTES = 64
"""Each host gradient's offset in its block's slab is a multiple of this (bytes)."""


def grad_layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of gradients of ``sizes`` bytes in one slab, and the bytes they span.

    Raises:
        nothing: arithmetic.
    """
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end = round_up(end + nbytes, GRAD_ALIGN_BYTES)
    return offsets, end


def block_grad_bytes(sizes: list[int]) -> int:
    """Pinned bytes of one block's host-gradient slab, for trainable weights of ``sizes``
    bytes (Note [host gradient slabs]).

    Raises:
        nothing: arithmetic.
    """
    return pinned_bytes(grad_layout(sizes)[1])


class _Slab:
    """One block's slab of one kind and each weight's region in it."""

    def __init__(self, buffer: PinnedBuffer, regions: dict[int, tuple[int, int, Any]]) -> None:
        self.buffer = buffer
        self.regions = regions  # id(entry) -> (offset, nbytes, entry: its id stays its own)


class GradSlabs:
    """The streamed weights' pinned host gradients and staging tensors (Note [host gradient
    slabs]). Thread-safe: a region is freed on whichever thread drops its last view.

    Args:
        pinner: pins the slabs (None: the process's cudaHostRegister one).
    """

    def __init__(self, pinner: Pinner | None = None) -> None:
        self._pinner = pinner
        self._slabs: dict[tuple[int, str], _Slab] = {}
        self._busy: set[int] = set()  # id(entry) whose acc region a live tensor holds
        self._lock = threading.Lock()
        self.fallbacks = 0
        """Host gradients that went to torch's pinned allocator (a region still held)."""

    def _slab(self, entry: Any, kind: str) -> _Slab:
        key = (entry.block.index, kind)
        slab = self._slabs.get(key)
        if slab is None:
            params = [p for p in entry.block.params if p.trainable]
            offsets, span = grad_layout([p.nbytes for p in params])
            pinner = self._pinner or default_pinner()
            slab = _Slab(pinner.alloc(span),
                         {id(p): (o, p.nbytes, p) for p, o in zip(params, offsets)})
            self._slabs[key] = slab
        return slab

    def _fallback(self, entry: Any, shape: torch.Size, dtype: torch.dtype,
                  why: str) -> torch.Tensor:
        self.fallbacks += 1
        if self.fallbacks == 1:
            logger.info("weight streaming: blocks[%d].%s's host gradient from torch's pinned "
                        "allocator (power-of-two rounded): %s", entry.block.index, entry.name,
                        why)
        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())

    def acc(self, entry: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host gradient for ``entry`` (a tiermem.stream.blocks.Param): its region of
        its block's slab, free again once every view of the returned tensor is dropped.

        Raises:
            RuntimeError: the OS refused to pin the slab.
        """
        slab = self._slab(entry, "acc")
        region = slab.regions.get(id(entry))
        nbytes = shape.numel() * dtype.itemsize
        if region is None or region[1] != nbytes or nbytes == 0:
            return self._fallback(entry, shape, dtype, "not laid out in its block's slab")
        with self._lock:
            if id(entry) in self._busy:
                held = True
            else:
                held = False
                self._busy.add(id(entry))
        if held:
            return self._fallback(entry, shape, dtype, "the previous one is still held")
        view = (ctypes.c_uint8 * nbytes).from_address(slab.buffer.tensor.data_ptr() + region[0])
        # the slab's buffer rides in the finalizer: its memory outlives every region's tensor
        weakref.finalize(view, self._free, id(entry), slab.buffer).atexit = False
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)

    def _free(self, key: int, buffer: PinnedBuffer) -> None:
        with self._lock:
            self._busy.discard(key)

    def staging(self, entry: Any, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``entry``'s pinned staging tensor (owned by the stream, reused every micro-batch).

        Raises:
            RuntimeError: the OS refused to pin the slab.
        """
        slab = self._slab(entry, "staging")
        region = slab.regions.get(id(entry))
        nbytes = shape.numel() * dtype.itemsize
        if region is None or region[1] != nbytes or nbytes == 0:
            return self._fallback(entry, shape, dtype, "not laid out in its block's slab")
        offset = region[0]
        return slab.buffer.tensor[offset:offset + nbytes].view(dtype).view(shape)

    @property
    def pinned_bytes(self) -> int:
        """Bytes the slabs pin (Note [host gradient slabs])."""
        return sum(s.buffer.pinned for s in self._slabs.values())

    def close(self) -> None:
        """Unpin every slab (the stream's close; a region still held stays valid, unpinned).

        Raises:
            RuntimeError: unpinning failed.
        """
        slabs, self._slabs = list(self._slabs.values()), {}
        for slab in slabs:
            slab.buffer.release()
