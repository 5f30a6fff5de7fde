"""Copies between the device and host tiers on dedicated CUDA streams, and their futures.

On CUDA, host->device copies run on one stream and device->host copies on another, so both
directions overlap each other and compute. Each copy records an event; a consumer's stream
waits on that event (never on the whole device). On a machine without CUDA the "device" is the
CPU: copies are plain synchronous ``copy_`` calls and every future is born done.

Note [side-stream buffers]: a tensor allocated for a copy on a side stream belongs to that
stream in torch's caching allocator; when it is handed to the consumer's stream, the consumer
waits on the copy event and the tensor is marked ``record_stream(consumer)`` so its memory is
not reused before the consumer is done with it.

Note [reaped reload]: the mark is needed on *every* hand-over, not only while the copy is in
flight. The store reaps finished moves at the start of each call, so a reload whose H2D copy
has landed is handed out with no move pending. Before the fix ``get`` marked the buffer only
when it still had to wait for a move; a reaped reload came back unmarked, and when autograd
freed it (on the host, while backward kernels reading it were still queued) its memory went
straight back to the H2D stream's pool. The next reload was then copied into that memory on
the H2D stream, which never waits for compute, overwriting data the queued kernels had yet to
read. It showed when the host was paced by the GPU long enough for a prefetch to land before
its ``get``: activation offload with gaps between offloaded blocks (``layers="auto"``,
non-contiguous ``layers``), and checkpointing, where a block's recomputation separates its
reloads. Contiguous blocks with ``prefetch_depth=1`` reached ``get`` before the copy landed
and were marked, so they trained right. Tested by
``tests/store/test_store_cuda.py::test_reaped_reload_is_not_overwritten``.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time
from typing import Callable

import torch


def _raise_stored(error: BaseException) -> None:
    """Raise a copy of a failed move's stored error, ``from`` it (Note [stored errors]).

    Note [stored errors]: raising an exception appends every frame it unwinds through to its
    traceback, and a frame that outlives its call keeps its locals and its caller's frame.
    A future's stored error is reachable from those locals (the future, the store's move), so
    raising the stored object itself made a reference cycle that kept every caller's locals
    alive until the garbage collector ran: after a failed spill, the saved activations of the
    step being offloaded (device memory on CUDA; tests/offload/test_spill_failure.py). A copy
    is raised instead, and the stored error is never raised here: nothing stored refers to the
    copy, so it and its frames are freed as soon as the caller drops it.
    """
    try:
        fresh = copy.copy(error)  # same type and fields (SpillError rebuilds through __reduce__)
    except Exception:  # a type copy cannot rebuild: the stored error (as before)
        raise error from None
    try:
        raise fresh from error
    finally:
        del fresh  # this frame is in the copy's traceback: it must not hold the copy


class TransferFuture:
    """The completion of one store move (a copy, a spill read, or a chain of them).

    ``done()`` polls, ``wait()`` blocks the calling thread. Buffers involved stay owned by the
    store until the future is done; the caller must not free them.
    """

    def __init__(self) -> None:
        self._stages_left = threading.Event()  # set when the last stage is issued
        self._cuda_event: torch.cuda.Event | None = None
        self._future: concurrent.futures.Future | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []

    @classmethod
    def completed(cls) -> "TransferFuture":
        """Return a future that is already done."""
        fut = cls()
        fut._stages_left.set()
        return fut

    def _set_event(self, event: torch.cuda.Event | None) -> None:
        self._cuda_event = event
        self._stages_left.set()

    def _set_future(self, future: concurrent.futures.Future) -> None:
        self._future = future
        self._stages_left.set()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._stages_left.set()

    def done(self) -> bool:
        """Return True when the data has arrived (or the move failed)."""
        if not self._stages_left.is_set():
            return False
        if self._error is not None:
            return True
        if self._future is not None and not self._future.done():
            return False
        return self._cuda_event is None or self._cuda_event.query()

    def wait(self, timeout: float | None = None) -> None:
        """Block until done.

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            Exception: the error of a failed move (e.g. ``SpillCorruption``, ``SpillError``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._stages_left.wait(timeout):
            raise TimeoutError(f"transfer not issued within {timeout} s")
        error = self._error
        if error is None and self._future is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                error = self._future.exception(left)  # not raised: Note [stored errors]
            except concurrent.futures.TimeoutError as exc:
                raise TimeoutError(f"transfer not done within {timeout} s") from exc
        if error is not None:
            _raise_stored(error)
        if self._cuda_event is not None:
            self._cuda_event.synchronize()  # host needs the bytes (a host reader or a caller of wait)

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for the data without blocking the host on the device copy.

        Raises:
            Exception: the error of a failed move.
        """
        if not self._stages_left.is_set():
            self._stages_left.wait()
        error = self._error
        if error is None and self._future is not None:
            error = self._future.exception()  # not raised: Note [stored errors]
        if error is not None:
            _raise_stored(error)
        if self._cuda_event is not None and stream is not None:
            stream.wait_event(self._cuda_event)  # consumer reads the copy's destination
        elif self._cuda_event is not None:
            self._cuda_event.synchronize()  # no consumer stream given: the host reads it

    def result(self) -> None:
        """Alias of :meth:`wait` for ``concurrent.futures`` style callers."""
        self.wait()


class Copier:
    """Issues device<->host copies on dedicated streams (CUDA) or synchronously (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            with torch.cuda.device(device):
                self.h2d_stream = torch.cuda.Stream(device)
                self.d2h_stream = torch.cuda.Stream(device)
        else:
            self.h2d_stream = self.d2h_stream = None

    def consumer_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream on the device (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def alloc_device(self, nbytes: int) -> torch.Tensor:
        """Allocate a uint8 device buffer owned by the H2D stream (Note [side-stream buffers])."""
        if self.cuda:
            with torch.cuda.stream(self.h2d_stream):
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy host ``src`` into device ``dst`` on the H2D stream; return the copy's event."""
        return self.h2d_many([(dst, src)])

    def h2d_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Copy each host ``src`` into its device ``dst`` on the H2D stream, in order, after
        ``after`` (an event the copies wait for, e.g. the last read of ``dst``); return one
        event marking all of them done (None on CPU or for no pairs)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        if not pairs:
            return None
        if after is not None:
            self.h2d_stream.wait_event(after)  # dst is free to overwrite at this event
        with torch.cuda.stream(self.h2d_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d_stream)  # marks the copies done for consumers and for freeing src
        return event

    def d2h(self, dst: torch.Tensor, src: torch.Tensor,
            after: torch.cuda.Event | None = None) -> torch.cuda.Event | None:
        """Copy device ``src`` into host ``dst`` on the D2H stream; return the copy's event.

        The D2H stream first waits for ``after`` (an event recorded where ``src`` was produced,
        for a copy issued from another thread) or else for the work queued so far on the
        caller's stream; ``src`` is marked as used by the D2H stream so its memory is not reused
        before the copy finishes.
        """
        return self.d2h_many([(dst, src)], after=after)

    def d2h_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 after: torch.cuda.Event | list[torch.cuda.Event] | None = None
                 ) -> torch.cuda.Event | None:
        """Copy each device ``src`` into its host ``dst`` on the D2H stream; return one event
        marking all of them done (None on CPU or for no pairs). ``after``: an event, or several,
        the copies wait for (see :meth:`d2h`)."""
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        if not pairs:
            return None
        if after is None:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))  # srcs must be produced
        else:
            for ev in (after if isinstance(after, list) else [after]):
                self.d2h_stream.wait_event(ev)  # a src is complete at this event
        with torch.cuda.stream(self.d2h_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h_stream)  # host may read the dsts / reuse the srcs after this
        for _, src in pairs:
            src.record_stream(self.d2h_stream)  # caching allocator: src in use until the copy ends
        return event

    def d2d(self, src: torch.Tensor) -> torch.Tensor:
        """Return a contiguous uint8 device copy of ``src`` on the caller's stream."""
        return src.reshape(-1).view(torch.uint8).clone()
