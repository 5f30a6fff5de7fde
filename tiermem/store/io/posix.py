"""The default I/O backend: a thread pool doing ``os.pwritev``/``os.preadv``.

Both calls release the GIL, so ``threads`` requests really run in parallel. Each request loops
on short transfers until every byte has moved, retries ``EINTR``/``EAGAIN`` and raises
``OSError`` with the errno, the file name and the byte offset otherwise. A read that reaches
the end of the file before the buffer is full raises :class:`ShortReadError`.
"""

from __future__ import annotations

import errno
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .base import IOBackend
from .reaper import note_thread, run_or_defer, start as start_reaper

_RETRY_ERRNOS = (errno.EINTR, errno.EAGAIN)
_MAX_RETRIES = 100
"""EINTR/EAGAIN retries of one system call before giving up (with a 1 ms pause each)."""


class ShortReadError(OSError):
    """A read hit the end of the file before the buffer was full (a truncated file).

    ``errno`` is ``ENODATA``; ``filename`` is the file; ``offset`` the byte offset where the
    missing data starts.
    """

    def __init__(self, path: str, offset: int, nbytes_missing: int | None) -> None:
        missing = "bytes" if nbytes_missing is None else f"{nbytes_missing} bytes"
        super().__init__(errno.ENODATA,
                         f"short read: end of file at offset {offset}, {missing} missing "
                         f"(file truncated?)", path)
        self.offset = offset


def host_view(buf: torch.Tensor, what: str = "buf") -> memoryview:
    """Return a writable byte ``memoryview`` of a contiguous CPU tensor (pinned or not).

    Raises:
        TypeError: ``buf`` is not a ``torch.uint8`` tensor on the CPU.
        ValueError: ``buf`` is not contiguous.
    """
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.device.type != "cpu":
        desc = (f"{buf.dtype} tensor on {buf.device}" if isinstance(buf, torch.Tensor)
                else type(buf).__name__)
        raise TypeError(f"{what} must be a torch.uint8 CPU tensor, got a {desc}")
    if not buf.is_contiguous():
        raise ValueError(f"{what} must be contiguous (call .contiguous() or pass a pool block)")
    return memoryview(buf.reshape(-1).numpy()).cast("B")


def os_error(exc: OSError, action: str, nbytes: int, offset: int, path: str) -> OSError:
    """Return an ``OSError(errno, "<strerror> (<action> <nbytes> bytes at offset <offset>)",
    path)`` for ``exc``."""
    reason = exc.strerror or str(exc)
    return OSError(exc.errno, f"{reason} ({action} {nbytes} bytes at offset {offset})", path)


class PosixHandle:
    """An open spill file of :class:`PosixBackend`: the descriptor and its path."""

    __slots__ = ("fd", "path", "o_direct")

    def __init__(self, fd: int, path: str, o_direct: bool) -> None:
        self.fd, self.path, self.o_direct = fd, path, o_direct

    def __repr__(self) -> str:
        return f"PosixHandle(fd={self.fd}, path={self.path!r}, o_direct={self.o_direct})"


def open_flags(create: bool, o_direct: bool) -> int:
    """Return the ``os.open`` flags of a spill file: read-write, no symlinks, close-on-exec,
    (``create``) exclusive creation, (``o_direct``) ``O_DIRECT``.

    Raises:
        OSError: ``o_direct`` on a platform without ``O_DIRECT`` (``EINVAL``).
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    if o_direct:
        if not hasattr(os, "O_DIRECT"):
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
        flags |= os.O_DIRECT
    return flags


def open_at(path: str, flags: int, dir_fd: int | None) -> int:
    """``os.open(path, flags, 0o600)``, or of ``path``'s base name relative to ``dir_fd``.

    Raises:
        OSError: as ``os.open``.
    """
    if dir_fd is None:
        return os.open(path, flags, 0o600)
    return os.open(os.path.basename(os.fspath(path)), flags, 0o600, dir_fd=dir_fd)


def pwrite_all(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Write all of ``view`` at byte ``offset`` of ``fd``; return the byte count.

    Loops on short writes, retries EINTR/EAGAIN.

    Raises:
        OSError: errno from ``pwritev`` (ENOSPC, EIO, ...) naming ``path`` and the offset.
    """
    total = view.nbytes
    done = 0
    retries = 0
    while done < total:
        try:
            n = os.pwritev(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno in _RETRY_ERRNOS and retries < _MAX_RETRIES:
                retries += 1
                time.sleep(0.001)
                continue
            raise os_error(exc, "writing", total - done, offset + done, path) from exc
        if n <= 0:  # pwrite never returns 0 for a non-empty buffer unless the device is stuck
            raise OSError(errno.EIO, f"write made no progress ({total - done} bytes at offset "
                          f"{offset + done})", path)
        done += n
    return total


def pread_all(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Fill all of ``view`` from byte ``offset`` of ``fd``; return the byte count.

    Loops on short reads, retries EINTR/EAGAIN.

    Raises:
        ShortReadError: end of file before ``view`` is full.
        OSError: errno from ``preadv`` (EIO, ...) naming ``path`` and the offset.
    """
    total = view.nbytes
    done = 0
    retries = 0
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno in _RETRY_ERRNOS and retries < _MAX_RETRIES:
                retries += 1
                time.sleep(0.001)
                continue
            raise os_error(exc, "reading", total - done, offset + done, path) from exc
        if n == 0:
            raise ShortReadError(path, offset + done, total - done)
        done += n
    return total


class PosixBackend(IOBackend):
    """Positional reads and writes on a pool of ``threads`` Python threads.

    Args:
        threads: worker threads; each runs one ``pwritev``/``preadv`` at a time (GIL released).

    Raises:
        ValueError: ``threads`` < 1.
    """

    name = "posix"

    def __init__(self, threads: int) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"StoreConfig.io_threads={threads!r} must be an int >= 1")
        self.threads = threads
        self._idents: set[int] = set()  # the pool's threads (see shutdown)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiermem-posix-io",
                                        initializer=note_thread, initargs=(self._idents,))
        start_reaper()  # where shutdown() may queue its join (Note [finalizer teardown])
        self._shut = False

    def open(self, path: str, *, create: bool, o_direct: bool,
             dir_fd: int | None = None) -> PosixHandle:
        """Open (``create``: exclusively create, mode 0600) ``path`` with O_NOFOLLOW; with
        ``dir_fd`` its base name in that directory (Note [spill dir by fd]).

        Raises:
            OSError: exists (``create``), is a symlink, permission, or ``EINVAL`` when the
                filesystem refuses O_DIRECT.
        """
        fd = open_at(path, open_flags(create, o_direct), dir_fd)
        return PosixHandle(fd, os.fspath(path), o_direct)

    def pwrite(self, handle: PosixHandle, buf: torch.Tensor, offset: int) -> Future:
        """Write all of ``buf`` at byte ``offset``; the future gives the byte count.

        ``buf`` must stay alive and unchanged until the future is done.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        view = host_view(buf)
        return self._submit(pwrite_all, handle.fd, view, offset, handle.path)

    def pread(self, handle: PosixHandle, buf: torch.Tensor, offset: int) -> Future:
        """Read ``buf.numel()`` bytes at ``offset`` into ``buf``; the future gives the count.

        The future raises :class:`ShortReadError` at end of file, ``OSError`` on I/O errors.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        view = host_view(buf)
        return self._submit(pread_all, handle.fd, view, offset, handle.path)

    def _submit(self, fn, *args) -> Future:
        if self._shut:
            raise RuntimeError(f"{type(self).__name__} is shut down; no new I/O can start")
        return self._pool.submit(fn, *args)

    def close_file(self, handle: PosixHandle) -> None:
        """Close the descriptor (idempotent). Pending requests on it must be finished.

        Raises:
            OSError: ``close`` failed (EIO on some filesystems).
        """
        fd, handle.fd = handle.fd, -1
        if fd >= 0:
            os.close(fd)

    def shutdown(self) -> None:
        """Wait for pending requests, then stop the threads. Idempotent.

        Called on one of the backend's own threads or inside a garbage collection it returns at
        once and the reaper does this (Note [finalizer teardown]).
        """
        self._shut = True
        run_or_defer(self._pool.shutdown, on_joined_thread=self.on_own_thread())
