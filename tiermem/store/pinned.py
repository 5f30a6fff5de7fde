"""Exactly sized pinned host memory: tiermem's long-lived pinned buffers pin the pages they use,
not the next power of two (Note [exact pinning]).

Note [exact pinning]: torch's pinned allocator (the CachingHostAllocator behind
``torch.empty(..., pin_memory=True)``) rounds every request up to the next power of two
(``c10::llvm::PowerOf2Ceil`` in ATen/core/CachingHostAllocator.h, unless the process sets
``pinned_max_round_threshold_mb`` in ``PYTORCH_ALLOC_CONF`` before CUDA starts) and caches the
block for reuse. For tiermem's buffers that is up to 2x the memory: a streamed 13B block's qkv
gradient of 150 MiB pinned 256 MiB (the 13B stream plan's 16.4 GiB of host gradients pinned
22.8 GiB), and a pool slab cut to 900 MiB (Note [slab tail]) pinned 1 GiB (the same plan's
17.0 GiB of slabs holding the streamed weights pinned 18.0), so a plan that filled a 125 GiB
host would have pinned ~125 GiB besides Python and the CUDA context on a 128 GiB machine. The
rounding is the caching allocator's, not pinning's: the store's pool slabs (tiermem/store/pool.py)
and the streamed weights' host gradients (Note [host gradient slabs] in
tiermem/stream/grad_slabs.py) are ordinary page-aligned CPU memory registered with
``cudaHostRegister`` (``torch.cuda.cudart()``, as torch's own checkpoint stager pins its
buffers) for exactly ``pinned_bytes(n)`` bytes (whole 4 KiB pages), and unregistered when
released. That is what tiermem.apps.plan counts. torch's copies treat registered memory as
pinned (``is_pinned()``; a non-blocking copy is asynchronous); the caching allocator does not
know it, so it keeps no event for it: the owner releases a buffer only once no copy uses it
(:meth:`PinnedBuffer.release` synchronizes the device first).

A :class:`Pinner` does the registering and counts the pinned bytes (``live_bytes``,
``peak_bytes``); tests inject one whose ``register`` is a fake, to replay the allocations and
compare them with the plan without a GPU.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch

from tiermem.store.extents import round_up

PAGE_BYTES = 4096


def pinned_bytes(nbytes: int) -> int:
    """Bytes a :class:`Pinner` pins for a request of ``nbytes``: whole pages, at least one.

    Raises:
        nothing: arithmetic.
    """
    return round_up(max(nbytes, 1), PAGE_BYTES)


def torch_pinned_bytes(nbytes: int) -> int:
    """Bytes torch's caching pinned allocator takes for ``nbytes`` with its default settings
    (the next power of two; Note [exact pinning]): what tiermem pinned before, for comparison.

    Raises:
        nothing: arithmetic.
    """
    return 1 << max(0, (max(nbytes, 1) - 1).bit_length())


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes failed (cudaError {err}): the "
                           f"OS refused to pin them (locked-memory limit, or RAM): lower the "
                           f"pinned budget (store cpu_bytes / budgets.host_bytes)")


def _cuda_unregister(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed (cudaError {err})")


class PinnedBuffer:
    """``nbytes`` of page-aligned host memory, pinned (registered) for ``pinned_bytes(nbytes)``
    until :meth:`release` (or until the buffer is garbage: then unregistered without waiting).

    Attributes:
        tensor: a uint8 view of ``nbytes`` bytes, page aligned.
        nbytes: as asked; pinned: the bytes registered.
    """

    def __init__(self, pinner: "Pinner", nbytes: int) -> None:
        self.nbytes = nbytes
        self.pinned = pinned_bytes(nbytes)
        raw = torch.empty(self.pinned + PAGE_BYTES, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % PAGE_BYTES
        whole = raw[skip:skip + self.pinned]
        pinner.register(whole.data_ptr(), self.pinned)
        self.tensor = whole[:nbytes]
        pinner.count(self.pinned)
        # unregistered before the memory can be freed: the finalizer runs while self (and so
        # the tensor it holds) is still alive; views that outlive it keep unpinned memory
        self._done = weakref.finalize(self, pinner.unpin, whole.data_ptr(), self.pinned)
        self._done.atexit = False  # at exit the process gives the pages back with the context

    def release(self) -> None:
        """Unregister the memory, once no copy uses it (the device is synchronized first).
        Idempotent. The tensor stays valid (unpinned) while anything refers to it.

        Raises:
            RuntimeError: cudaHostUnregister failed.
        """
        if self._done.alive and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a copy in flight may still read or write the pages
        self._done()


class Pinner:
    """Pins host buffers exactly (Note [exact pinning]) and counts the bytes.

    Args:
        register: ``register(ptr, nbytes)`` pins; None: ``cudaHostRegister``.
        unregister: ``unregister(ptr)``; None: ``cudaHostUnregister``.

    Attributes:
        live_bytes, peak_bytes: pinned bytes now / at most; live_buffers: buffers now.
    """

    def __init__(self, register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        self.register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.live_buffers = 0

    def alloc(self, nbytes: int) -> PinnedBuffer:
        """A pinned buffer of ``nbytes`` bytes (``pinned_bytes(nbytes)`` pinned).

        Raises:
            RuntimeError: the OS refused to pin the memory.
        """
        return PinnedBuffer(self, nbytes)

    def count(self, nbytes: int) -> None:
        """Count ``nbytes`` pinned (a buffer's registration)."""
        with self._lock:
            self.live_bytes += nbytes
            self.live_buffers += 1
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def unpin(self, ptr: int, nbytes: int) -> None:
        """Unregister the buffer at ``ptr`` (``nbytes`` pinned) and stop counting it."""
        with self._lock:
            self.live_bytes -= nbytes
            self.live_buffers -= 1
        self._unregister(ptr)


_DEFAULT: Pinner | None = None


def default_pinner() -> Pinner:
    """The process's :class:`Pinner` (cudaHostRegister); its counters cover every buffer
    tiermem pinned through it.

    Raises:
        nothing: created on first use.
    """
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Pinner()
    return _DEFAULT
