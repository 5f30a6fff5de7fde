"""I/O backend on kvikio's ``CuFile``, reading and writing pinned host buffers.

What it does: the spill path (:class:`~tiermem.store.nvme.SpillSpace`) hands every backend
pinned *host* buffers, so kvikio serves them with its own POSIX ``pread``/``pwrite`` on its
thread pool. GPUDirect Storage (device memory straight to the file) is never used: no device
buffer reaches this backend. ``io_backend="auto"`` does not pick it (see
:mod:`tiermem.store.io`); name it (``io_backend="kvikio"``) to use it.

kvikio is imported lazily: importing this module never needs it. kvikio imports on machines
without a GPU, but every read and write then fails because it needs the CUDA driver library
``libcuda.so.1`` even for host buffers; :func:`kvikio_usable` checks both. kvikio takes numpy
views of host tensors (``t.numpy()``), not torch tensors.

``CuFile.pread``/``pwrite`` split a request into ``task_size`` pieces on kvikio's own global
thread pool and return an ``IOFuture``; this backend sets that pool to ``threads`` threads and
turns each ``IOFuture`` into a ``concurrent.futures.Future`` by waiting on it
(``IOFuture.get`` releases the GIL) on a small pool of waiter threads.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import importlib
import importlib.util
import os
import stat
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .base import IOBackend
from .posix import ShortReadError, host_view, open_at, open_flags
from .reaper import note_thread, run_or_defer, start as start_reaper


@functools.lru_cache(maxsize=1)
def kvikio_usable() -> tuple[bool, str]:
    """Return ``(True, "")`` when kvikio imports and a CUDA driver is present, else
    ``(False, reason)``. Cached: the answer does not change within a process.
    """
    if importlib.util.find_spec("kvikio") is None:
        return False, "kvikio is not installed (pip install 'tiermem[kvikio]', i.e. kvikio-cu13)"
    try:
        importlib.import_module("kvikio")
    except Exception as exc:  # a broken install raises anything (ImportError, OSError, ...)
        return False, f"kvikio is installed but does not import: {type(exc).__name__}: {exc}"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return False, (f"no CUDA driver: libcuda.so.1 does not load ({exc}); kvikio needs it "
                       f"even for host buffers")
    return True, ""


def set_kvikio_threads(kvikio, threads: int) -> None:
    """Set kvikio's global thread pool size (``defaults.set`` in kvikio >= 25.04, else the
    older ``num_threads_reset``); the backend and ``tiermem bench io`` call it.

    Args:
        kvikio: the imported ``kvikio`` module.
        threads: the pool's size (>= 1).

    Raises:
        Nothing of its own: kvikio's errors pass through.
    """
    defaults = importlib.import_module("kvikio.defaults")  # a submodule: not imported by kvikio
    if hasattr(defaults, "set"):
        defaults.set("num_threads", threads)
    else:
        defaults.num_threads_reset(threads)


class KvikioHandle:
    """An open spill file of :class:`KvikioBackend`: the ``CuFile`` and its path."""

    __slots__ = ("cufile", "path", "o_direct")

    def __init__(self, cufile, path: str, o_direct: bool) -> None:
        self.cufile, self.path, self.o_direct = cufile, path, o_direct

    def __repr__(self) -> str:
        return f"KvikioHandle(path={self.path!r})"


class KvikioBackend(IOBackend):
    """Reads and writes pinned host buffers through ``kvikio.CuFile`` (kvikio's POSIX I/O on
    its own thread pool; no GPUDirect Storage: only host buffers are passed).

    Args:
        threads: size of kvikio's (process-global) thread pool; set at construction.

    Raises:
        ValueError: ``threads`` < 1, or kvikio is not usable here (the reason is in the message).
    """

    name = "kvikio"

    def __init__(self, threads: int) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"StoreConfig.io_threads={threads!r} must be an int >= 1")
        ok, reason = kvikio_usable()
        if not ok:
            raise ValueError(f"StoreConfig.io_backend='kvikio' is not usable here: {reason}; "
                             f"fix: set io_backend='posix' (or 'auto')")
        import kvikio  # noqa: PLC0415  (lazy: kvikio is an optional dependency)

        self._kvikio = kvikio
        self.threads = threads
        set_kvikio_threads(kvikio, threads)
        # Waiters block in IOFuture.get() (GIL released) until kvikio's pool finishes a request.
        self._idents: set[int] = set()  # the waiters' threads (see shutdown)
        self._waiters = ThreadPoolExecutor(max_workers=max(2, threads),
                                           thread_name_prefix="tiermem-kvikio-wait",
                                           initializer=note_thread,
                                           initargs=(self._idents,))
        start_reaper()  # where shutdown() may queue its join (Note [finalizer teardown])
        self._shut = False

    def open(self, path: str, *, create: bool, o_direct: bool,
             dir_fd: int | None = None) -> KvikioHandle:
        """Open ``path`` as a ``CuFile`` in ``"r+"`` mode; ``create`` first creates it
        exclusively (O_EXCL, O_NOFOLLOW, mode 0600) with ``os.open``. With ``dir_fd`` the file
        is ``path``'s base name in that directory, reached through ``/proc/self/fd/<dir_fd>``
        (the directory held, whatever its path names by now: Note [spill dir by fd]).

        kvikio decides about O_DIRECT itself (it opens a second O_DIRECT descriptor); the
        ``o_direct`` flag is recorded for callers that size their buffers by it.

        Raises:
            OSError: exists (``create``), is a symlink or not a regular file, permission, or
                kvikio cannot open/register it.
        """
        path = os.fspath(path)
        name = os.path.basename(path) if dir_fd is not None else path
        if create:
            os.close(open_at(path, open_flags(create=True, o_direct=False), dir_fd))
        st = os.lstat(name, dir_fd=dir_fd)
        if not stat.S_ISREG(st.st_mode):  # kvikio follows symlinks; refuse them here
            raise OSError(f"spill file {path} is not a regular file (symlink?); refusing to open")
        where = path if dir_fd is None else f"/proc/self/fd/{dir_fd}/{name}"
        try:
            cufile = self._kvikio.CuFile(where, "r+")
        except Exception as exc:
            raise OSError(f"kvikio.CuFile({where!r}, 'r+') failed: "
                          f"{type(exc).__name__}: {exc}") from exc
        return KvikioHandle(cufile, path, o_direct)

    def pwrite(self, handle: KvikioHandle, buf: torch.Tensor, offset: int) -> Future:
        """Write all of ``buf`` at byte ``offset``; the future gives the byte count.

        ``buf`` must stay alive and unchanged until the future is done.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        host_view(buf)  # validates dtype/device/contiguity
        arr = buf.reshape(-1).numpy()
        self._check_open()
        iofuture = handle.cufile.pwrite(arr, arr.nbytes, offset)
        return self._waiters.submit(self._wait, iofuture, arr, offset, handle.path, "writing")

    def pread(self, handle: KvikioHandle, buf: torch.Tensor, offset: int) -> Future:
        """Read ``buf.numel()`` bytes at ``offset`` into ``buf``; the future gives the count.

        The future raises :class:`~tiermem.store.io.posix.ShortReadError` at end of file and
        ``OSError`` when kvikio fails.

        Raises:
            TypeError/ValueError: ``buf`` is not a contiguous uint8 CPU tensor.
            RuntimeError: the backend is shut down.
        """
        host_view(buf)
        arr = buf.reshape(-1).numpy()
        self._check_open()
        iofuture = handle.cufile.pread(arr, arr.nbytes, offset)
        return self._waiters.submit(self._wait, iofuture, arr, offset, handle.path, "reading")

    def _check_open(self) -> None:
        if self._shut:
            raise RuntimeError("KvikioBackend is shut down; no new I/O can start")

    @staticmethod
    def _wait(iofuture, arr, offset: int, path: str, action: str) -> int:
        # ``arr`` is passed only to keep the buffer alive until kvikio is done with it.
        nbytes = arr.nbytes
        try:
            moved = iofuture.get()
        except Exception as exc:  # kvikio raises RuntimeError/system_error with a message
            if action == "reading" and "EOF" in str(exc):  # "POSIX error on pread: EOF"
                raise ShortReadError(path, offset, None) from exc
            err = getattr(exc, "errno", None)
            raise OSError(err or errno.EIO, f"kvikio failed {action} {nbytes} bytes at offset "
                          f"{offset}: {type(exc).__name__}: {exc}", path) from exc
        if moved != nbytes:
            if action == "reading":
                raise ShortReadError(path, offset + moved, nbytes - moved)
            raise OSError(errno.EIO, f"short write: kvikio wrote {moved} of {nbytes} bytes at "
                          f"offset {offset}", path)
        return moved

    def close_file(self, handle: KvikioHandle) -> None:
        """Deregister and close the ``CuFile`` (idempotent)."""
        cufile, handle.cufile = handle.cufile, None
        if cufile is not None:
            cufile.close()

    def shutdown(self) -> None:
        """Wait for pending requests, then stop the waiter threads. Idempotent.

        Called on a waiter thread or inside a garbage collection it returns at once and the
        reaper does this (Note [finalizer teardown]).
        """
        self._shut = True
        run_or_defer(self._waiters.shutdown, on_joined_thread=self.on_own_thread())
