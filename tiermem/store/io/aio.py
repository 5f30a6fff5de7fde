"""I/O backend through ``aiofiles`` (the asyncio file API), for asyncio users of the store.

aiofiles wraps blocking file calls in ``loop.run_in_executor``. This backend runs a private
asyncio event loop in a background thread; each request is a coroutine scheduled there with
``asyncio.run_coroutine_threadsafe`` (which hands back a ``concurrent.futures.Future``). The
spill file is opened once (relative to the private directory's descriptor) and every request
is a positional ``pwritev``/``preadv`` on that descriptor, run through ``aiofiles.os.wrap`` on
the backend's executor: no request reopens the file by path, so a directory renamed away and
replaced by a look-alike gets no byte (Note [spill dir by fd]).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import aiofiles.os
import torch

from .base import IOBackend
from .posix import host_view, open_at, open_flags, pread_all, pwrite_all
from .reaper import note_thread, run_or_defer, start as start_reaper


_pwrite_all = aiofiles.os.wrap(pwrite_all)  # coroutines running these on a given executor
_pread_all = aiofiles.os.wrap(pread_all)


def _run_loop(loop: asyncio.AbstractEventLoop, idents: set) -> None:
    """The loop thread: holds the loop, not the backend, so a dropped backend can be collected
    (its finalizer then stops the loop)."""
    note_thread(idents)
    loop.run_forever()


class AioHandle:
    """An open spill file of :class:`AiofilesBackend`: the descriptor every request uses
    (positional I/O, so concurrent requests need no position of their own), the path (for
    messages) and the O_DIRECT flag."""

    __slots__ = ("fd", "path", "o_direct")

    def __init__(self, fd: int, path: str, o_direct: bool) -> None:
        self.fd, self.path, self.o_direct = fd, path, o_direct

    def __repr__(self) -> str:
        return f"AioHandle(path={self.path!r}, o_direct={self.o_direct})"


class AiofilesBackend(IOBackend):
    """Positional I/O via ``aiofiles`` on a private event loop with ``threads`` executor threads.

    Args:
        threads: executor threads aiofiles runs the blocking calls on (2 is best on 2 cores).

    Raises:
        ValueError: ``threads`` < 1.
    """

    name = "aiofiles"

    def __init__(self, threads: int) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"StoreConfig.io_threads={threads!r} must be an int >= 1")
        self.threads = threads
        self._idents: set[int] = set()  # the loop's and the executor's threads (see shutdown)
        self._executor = ThreadPoolExecutor(max_workers=threads,
                                            thread_name_prefix="tiermem-aiofiles-io",
                                            initializer=note_thread,
                                            initargs=(self._idents,))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run_loop, args=(self._loop, self._idents),
                                        name="tiermem-aiofiles-loop", daemon=True)
        self._thread.start()
        start_reaper()  # where shutdown() may queue its joins (Note [finalizer teardown])
        # Guards _pending and _shut: requests are submitted from any thread.
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._shut = False

    def open(self, path: str, *, create: bool, o_direct: bool,
             dir_fd: int | None = None) -> AioHandle:
        """Open (``create``: exclusively create, mode 0600) ``path`` with O_NOFOLLOW; with
        ``dir_fd`` its base name in that directory (Note [spill dir by fd]).

        Raises:
            OSError: exists (``create``), is a symlink, permission, or ``EINVAL`` when the
                filesystem refuses O_DIRECT.
        """
        path = os.fspath(path)
        fd = open_at(path, open_flags(create, o_direct), dir_fd)
        return AioHandle(fd, path, o_direct)

    def pwrite(self, handle: AioHandle, buf: torch.Tensor, offset: int) -> Future:
        """Write all of ``buf`` at byte ``offset``; the future gives the byte count.

        ``buf`` must stay alive and unchanged until the future is done.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        return self._submit(self._awrite(handle, host_view(buf), offset))

    def pread(self, handle: AioHandle, buf: torch.Tensor, offset: int) -> Future:
        """Read ``buf.numel()`` bytes at ``offset`` into ``buf``; the future gives the count.

        The future raises :class:`~tiermem.store.io.posix.ShortReadError` at end of file and
        ``OSError`` on I/O errors.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        return self._submit(self._aread(handle, host_view(buf), offset))

    def _submit(self, coro) -> Future:
        with self._lock:  # _shut and _pending are shared with shutdown() on another thread
            if self._shut:
                coro.close()
                raise RuntimeError("AiofilesBackend is shut down; no new I/O can start")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(fut)
        fut.add_done_callback(self._discard)
        return fut

    def _discard(self, fut: Future) -> None:
        with self._lock:  # see _submit
            self._pending.discard(fut)

    async def _awrite(self, handle: AioHandle, view: memoryview, offset: int) -> int:
        return await _pwrite_all(handle.fd, view, offset, handle.path, loop=self._loop,
                                 executor=self._executor)

    async def _aread(self, handle: AioHandle, view: memoryview, offset: int) -> int:
        return await _pread_all(handle.fd, view, offset, handle.path, loop=self._loop,
                                executor=self._executor)

    def close_file(self, handle: AioHandle) -> None:
        """Close the handle's descriptor (idempotent). Pending requests on it must be finished."""
        fd, handle.fd = handle.fd, -1
        if fd >= 0:
            os.close(fd)

    def shutdown(self) -> None:
        """Wait for pending requests, stop the event loop and the executor. Idempotent.

        Called on one of the backend's own threads (a finalizer run by an I/O callback) or
        inside a garbage collection it returns at once and the reaper does this (Note
        [finalizer teardown]).
        """
        with self._lock:  # see _submit
            if self._shut:
                return
            self._shut = True
        run_or_defer(self._stop, on_joined_thread=self.on_own_thread())

    def _stop(self) -> None:
        with self._lock:  # see _submit
            pending = list(self._pending)
        wait(pending)  # requests still use the loop and executor: let them finish first
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._executor.shutdown(wait=True)
