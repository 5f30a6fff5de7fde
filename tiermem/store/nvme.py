"""The NVMe tier's spill space: one spill file in a private directory, aligned extents in it.

A :class:`SpillSpace` owns a private directory ``<base_dir>/tiermem-<pid>-<random>`` (mode
0700, checked after creation) holding one spill file (mode 0600, created with O_EXCL and
O_NOFOLLOW). Extents are 4096-byte aligned ranges of that file handed out by a first-fit,
coalescing :class:`~tiermem.store.extents.ExtentAllocator` over ``[0, capacity_bytes)``; the
file grows with ``posix_fallocate`` to cover the highest extent, so a full disk shows up as
ENOSPC before any byte is written. Each write is split into ``chunk_bytes`` pieces submitted in
parallel to an :class:`~tiermem.store.io.base.IOBackend`, each with its own checksum (CRC-32C
from ``tiermem._native`` when built, else zlib's CRC-32) verified on read.

The directory is made by :func:`tiermem._leftovers.make_owned_dir`, with a marker file (kind,
pid, process start time, random id) that cleanup checks before it removes anything. It is
used only through descriptors once made (Note [spill dir by fd], :mod:`.spill_dir`), so a
directory renamed away and replaced by a look-alike gets no byte and loses no file. It is
removed by :meth:`SpillSpace.close`, by a ``weakref.finalize`` when the space is
garbage-collected, and at interpreter exit (the finalizer is registered with atexit), which
also shuts down a backend the space owns; directories of dead processes are removed by
:func:`cleanup_stale` when a new space is made. Removal unlinks only the marker and the spill
file, so a directory holding anything else stays.

Note [spill space after fork]: only the process that made a space removes its directory or
shuts its backend down. A child forked while a space is alive inherits the object (and a copy
of its descriptors) but not the backend's threads, and maybe its locks held (Note [inherited],
``fork.py``): in the child, :meth:`SpillSpace.close` and the finalizer take no lock, wait for
nothing and only close the child's copies of the descriptors, so a child that exits, closes or
drops it leaves the parent's files alone; ``write``/``read`` in the child raise ``ValueError``.

Note [spill buffer lifetime]: ``write``/``read`` return futures; the caller's buffer must stay
alive and must not be modified (write) or used (read) until the future is done. Buffers that are
not 4096-byte aligned while O_DIRECT is on, or shorter than the extent's ``alloc_bytes``, go
through an aligned bounce buffer (one extra host copy) — pool blocks never need one. When a
future raises, nothing was lost: a failed write leaves the caller's bytes in place and frees the
extent; a failed read leaves the extent allocated and the buffer's contents undefined.

The errors (Note [spill errors]) are in :mod:`.spill_errors`.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import re
import threading
import weakref
import zlib
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Callable, Hashable, Literal

import torch

from .._leftovers import make_owned_dir, remove_owned_dir, stale_dirs
from ..names import AUTO_BOOL, check_aligned, check_bool, check_choice, check_int
from .extents import ExtentAllocator, round_up
from .io.base import IOBackend
from .io.posix import ShortReadError, host_view
from .io.reaper import run_or_defer, start as start_reaper
from .fork import track as track_forks
from .spill_dir import PrivateDir
from .spill_errors import SpillCorruption, SpillError, SpillFull

ALIGN_BYTES = 4096
"""Alignment of extent offsets, sizes and O_DIRECT buffers (bytes)."""

logger = logging.getLogger("tiermem")

SPILL_DIR_PREFIX = "tiermem-"
_SPILL_DIR_RE = re.compile(r"tiermem-(?P<pid>\d+)-(?P<id>[0-9a-f]+)")
SPILL_FILE_NAME = "spill.bin"
_SPILL_KIND = "spill"


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Extent:
    """Where a spilled buffer lives in the spill file.

    Attributes:
        offset: byte offset in the spill file (multiple of 4096).
        nbytes: logical bytes (what the caller asked to spill).
        alloc_bytes: bytes reserved and written, ``nbytes`` rounded up to 4096.
        checksums: one checksum per ``chunk_bytes`` chunk of the logical bytes (empty when
            checksums are off).
        generation: cuts of the spill file seen when its write began (Note [cut spill file]).
    """

    offset: int
    nbytes: int
    alloc_bytes: int
    checksums: tuple[int, ...] = ()
    generation: int = 0


@functools.lru_cache(maxsize=1)
def checksum_impl() -> tuple[str, Callable[[object], int]]:
    """Return ``(name, fn)`` of the chunk checksum: ``("crc32c", tiermem._native.crc32c)``
    when the native core is built and available, else ``("crc32", zlib.crc32)``.

    ``fn`` takes a C-contiguous uint8 numpy array and returns an unsigned int; both release the
    GIL on large buffers. Chosen once per process (extents never outlive the process).
    """
    try:
        from tiermem import _native  # noqa: PLC0415  (optional; may not be built)

        if _native.available():
            return "crc32c", _native.crc32c
    except (ImportError, AttributeError, OSError):  # not built / old build: zlib fallback
        pass
    return "crc32", zlib.crc32


def aligned_empty(nbytes: int) -> torch.Tensor:
    """Return an uninitialised (zero-filled) uint8 CPU tensor of ``nbytes`` whose data pointer is
    4096-byte aligned, backed by an anonymous ``mmap`` (kept alive by the tensor).

    Raises:
        ValueError: ``nbytes`` < 0.
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty nbytes={nbytes} must be >= 0")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def cleanup_stale(base_dir: str | os.PathLike) -> list[str]:
    """Remove spill directories ``tiermem-<pid>-<id>`` under ``base_dir`` left by dead processes.

    A directory is removed only when tiermem made it (a real directory of this user whose
    marker agrees with its name, holding nothing but the marker and the spill file, see
    :mod:`tiermem._leftovers`) and its writer is gone (dead pid, or a pid reused by a process
    with another start time). Live processes' directories, other users' directories, look-alike
    names without a marker and anything unreadable are left alone. A base directory shared
    between PID namespaces (containers) may see a live process as dead: give each container its
    own ``nvme_dir``.

    Returns:
        The paths removed.
    """
    removed: list[str] = []
    for path in stale_dirs(base_dir, _SPILL_DIR_RE, _SPILL_KIND, (SPILL_FILE_NAME,)):
        if remove_owned_dir(path, (SPILL_FILE_NAME,)):
            removed.append(path)
    return removed


def _remove_spill(backend: IOBackend, handle: object, fd: int, private: PrivateDir,
                  owner_pid: int, owns_backend: bool) -> None:
    """Finalizer: shut down an owned backend (pending I/O first), close the spill file's
    handles and remove the directory; in a forked child only close the child's descriptors
    (Note [spill space after fork]). Inside a garbage collection or on one of the backend's
    threads, where its threads cannot be joined, all of it runs on the reaper, in this order
    (Note [finalizer teardown]). Best effort."""
    teardown = functools.partial(_teardown_spill, backend, handle, fd, private, owner_pid,
                                 owns_backend)
    if os.getpid() == owner_pid and owns_backend:
        run_or_defer(teardown, on_joined_thread=backend.on_own_thread())
    else:
        teardown()


def _teardown_spill(backend: IOBackend, handle: object, fd: int, private: PrivateDir,
                    owner_pid: int, owns_backend: bool) -> None:
    """The work of :func:`_remove_spill`, here and now."""
    mine = os.getpid() == owner_pid
    if mine and owns_backend:
        try:
            backend.shutdown()
        except Exception as exc:  # noqa: BLE001  (teardown: the directory must go regardless)
            logger.warning("tiermem: shutting down the %s I/O backend failed: %s",
                           getattr(backend, "name", "?"), exc)
    try:
        if handle is not None and mine:
            backend.close_file(handle)
        elif isinstance(getattr(handle, "fd", None), int) and handle.fd >= 0:
            os.close(handle.fd)  # the child's copy; the backend (its threads) is the parent's
    except Exception:  # noqa: BLE001  (see above)
        pass
    try:
        os.close(fd)
    except OSError:
        pass
    if mine:
        private.remove((SPILL_FILE_NAME,))  # Note [spill dir by fd]
    else:
        private.close()  # the child's copy of the descriptor only


def _is_retryable(exc: BaseException, kind: str) -> bool:
    if isinstance(exc, (ShortReadError, _ChecksumMismatch)):
        return kind == "read"
    return isinstance(exc, OSError) and exc.errno == errno.EIO


class _ChecksumMismatch(Exception):
    def __init__(self, stored: int, got: int) -> None:
        super().__init__(f"stored {stored:#010x}, read {got:#010x}")


class _Op:
    """One extent write or read in flight: counts outstanding chunks, keeps the first error."""

    __slots__ = ("kind", "key", "offset", "nbytes", "alloc_bytes", "data", "data_np", "user_buf",
                 "checksums", "future", "remaining", "error", "lock", "generation")

    def __init__(self, kind: str, key: Hashable, offset: int, nbytes: int, alloc_bytes: int,
                 data: torch.Tensor, user_buf: torch.Tensor | None, nchunks: int) -> None:
        self.kind, self.key, self.offset = kind, key, offset
        self.nbytes, self.alloc_bytes = nbytes, alloc_bytes
        self.data = data                  # the bytes on the wire: the caller's buffer or a bounce
        self.data_np = data.numpy()
        self.user_buf = user_buf          # read through a bounce: copy back here on success
        self.checksums = [0] * nchunks
        self.future: Future = Future()
        self.remaining = 1                # +1 held by the submitter until all chunks are queued
        self.error: tuple[BaseException, int] | None = None
        self.lock = threading.Lock()      # chunk callbacks run concurrently on backend threads
        self.generation = 0               # Note [cut spill file]: set by write() before I/O

    def fail(self, exc: BaseException, file_offset: int) -> None:
        """Record a chunk's failure; the one at the lowest file offset is reported."""
        with self.lock:  # see __init__
            if self.error is None or file_offset < self.error[1]:
                self.error = (exc, file_offset)

    def release(self) -> bool:
        """Drop one outstanding count; True for the caller that dropped the last one."""
        with self.lock:  # see __init__
            self.remaining -= 1
            return self.remaining == 0


# ---------------------------------------------------------------------------------------------
# the spill space


class SpillSpace:
    """Extents of one spill file in a private directory, written and read through a backend.

    Thread-safe: ``write``/``read``/``free`` may be called from any thread.

    Args:
        base_dir: existing writable directory (``StoreConfig.nvme_dir``); the private
            ``tiermem-<pid>-<random>`` directory is made inside it.
        capacity_bytes: most bytes of extents at once (``StoreConfig.nvme_bytes``), rounded
            down to 4096.
        backend: the I/O backend (see :func:`tiermem.store.io.make_backend`). The space closes
            its own file handle; the backend is shut down by its owner (``owns_backend``).
        o_direct: ``True``, ``False`` or ``"auto"`` (probe: O_DIRECT when the filesystem
            accepts an aligned O_DIRECT write and read; tmpfs does not).
        checksum: compute a checksum per chunk on write and verify it on read.
        chunk_bytes: I/O request size in bytes (multiple of 4096); chunks of one extent run in
            parallel and each has its own checksum.
        io_retries: extra attempts of a chunk after EIO / a short read / (reads) a checksum
            mismatch.
        owns_backend: :meth:`close` also shuts the backend down.

    Raises:
        ValueError: ``base_dir`` missing or not writable, bad capacity/chunk size/o_direct/
            checksum/io_retries, ``o_direct=True`` on a filesystem without O_DIRECT; each
            message names the ``StoreConfig`` field (or ``SpillSpace: io_retries``) and the fix.
        TypeError: a capacity, chunk size or ``io_retries`` that is not an int; a backend that
            is not an IOBackend.
    """

    def __init__(self, base_dir: str | os.PathLike, capacity_bytes: int, *, backend: IOBackend,
                 o_direct: bool | Literal["auto"] = "auto", checksum: bool = True,
                 chunk_bytes: int = 8 << 20, io_retries: int = 2,
                 owns_backend: bool = False) -> None:
        check_int("StoreConfig.", "nvme_bytes", capacity_bytes, low=ALIGN_BYTES, unit="bytes",
                  fix="0 disables the nvme tier; anything above needs one aligned block")
        check_aligned("StoreConfig.", "io_chunk_bytes", chunk_bytes, ALIGN_BYTES,
                      "O_DIRECT alignment")
        check_choice("StoreConfig.", "o_direct", o_direct, AUTO_BOOL,
                     "auto uses O_DIRECT when the filesystem supports it")
        check_bool("StoreConfig.", "checksum", checksum)
        check_int("SpillSpace: ", "io_retries", io_retries, low=0, unit="extra attempts")
        if not isinstance(backend, IOBackend):
            raise TypeError(f"SpillSpace backend must be an IOBackend "
                            f"(tiermem.store.io.make_backend), got {type(backend).__name__}")
        self._backend = backend
        self._owns_backend = owns_backend
        self._checksum = bool(checksum)
        self._chunk_bytes = chunk_bytes
        self._io_retries = io_retries
        self._alloc = ExtentAllocator(capacity_bytes, ALIGN_BYTES, fit="first")
        # Guards the allocator, counters, _ops and _closed; never held during I/O.
        self._lock = threading.Lock()
        # Serialises file growth so _file_bytes only counts bytes that were really allocated.
        self._grow_lock = threading.Lock()
        self._ops: set[_Op] = set()
        self._closed = False
        self._bytes_written = 0
        self._bytes_read = 0
        self._file_bytes = 0
        self._cuts: list[int] = []  # sizes the file was cut to by others: Note [cut spill file]

        base = os.fspath(base_dir)
        self.removed_stale_dirs = cleanup_stale(base) if os.path.isdir(base) else []
        """Stale directories of dead processes removed when this space was made."""
        self._dir_path = self._make_private_dir(base)
        self._path = os.path.join(self._dir_path, SPILL_FILE_NAME)
        self._private = self._open_private_dir(self._dir_path, backend, owns_backend)
        self._fd = -1
        handle = None
        try:  # everything by descriptor from here on (Note [spill dir by fd])
            # Control descriptor (buffered): creates the file exclusively; used to grow it.
            self._fd = self._private.open(SPILL_FILE_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL
                                          | os.O_NOFOLLOW | os.O_CLOEXEC)
            os.fchmod(self._fd, 0o600)  # exact mode whatever the umask
            self._o_direct = self._choose_o_direct(o_direct)
            handle = backend.open(self._path, create=False, o_direct=self._o_direct,
                                  dir_fd=self._private.fd)
            handle_fd = getattr(handle, "fd", None)
            if handle_fd is not None and not self._private.same_file(handle_fd, self._fd):
                raise OSError(f"{self._path} was replaced while it was being opened")
        except BaseException:
            _remove_spill(backend, handle, self._fd, self._private, os.getpid(), owns_backend)
            raise
        self._handle = handle
        self._pid = os.getpid()  # Note [spill space after fork]
        self._inherited = False  # set in a forked child (Note [inherited])
        track_forks(self)
        start_reaper()  # where the finalizer may queue the teardown (Note [finalizer teardown])
        # shuts an owned backend down too: a space dropped without close() leaks no threads
        self._finalizer = weakref.finalize(self, _remove_spill, backend, handle, self._fd,
                                           self._private, self._pid, owns_backend)
        self._finalizer.atexit = True  # also at interpreter exit (the default; stated on purpose)

    def _after_fork_in_child(self) -> None:
        """In a forked child (Note [inherited]): refuse I/O from now on; the locks copied from
        the parent, maybe held, are replaced and never taken."""
        self._inherited = True
        self._lock, self._grow_lock = threading.Lock(), threading.Lock()

    # -- construction helpers ---------------------------------------------------------------
    @staticmethod
    def _make_private_dir(base: str) -> str:
        fix = ("fix: point StoreConfig.nvme_dir at an existing directory you can write, on an "
               "SSD (or set nvme_bytes=0 to disable the nvme tier)")
        if not os.path.isdir(base):
            raise ValueError(f"StoreConfig.nvme_dir={base!r} is not writable: it does not exist "
                             f"or is not a directory; {fix}")
        try:
            return make_owned_dir(base, SPILL_DIR_PREFIX, _SPILL_KIND)
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            raise ValueError(f"StoreConfig.nvme_dir={base!r} is not writable: cannot create a "
                             f"private directory{where}: {exc.strerror or exc}; {fix}") from exc

    @staticmethod
    def _open_private_dir(path: str, backend: IOBackend, owns_backend: bool) -> PrivateDir:
        try:
            return PrivateDir(path)
        except OSError as exc:
            if owns_backend:
                backend.shutdown()
            raise ValueError(f"StoreConfig.nvme_dir: cannot use the private directory {path}: "
                             f"{exc.strerror or exc}; use an nvme_dir only you can write") from exc

    def _choose_o_direct(self, want: bool | str) -> bool:
        if want is False:
            return False
        ok, reason = self._probe_o_direct()
        if want is True and not ok:
            raise ValueError(
                f"StoreConfig.o_direct=True but the filesystem of {self._dir_path} does not "
                f"support O_DIRECT ({reason}; tmpfs never does); fix: o_direct='auto' (buffered "
                f"fallback) or put StoreConfig.nvme_dir on an SSD filesystem such as ext4/xfs")
        return ok

    def _probe_o_direct(self) -> tuple[bool, str]:
        """Try an aligned 4096-byte O_DIRECT write and read of the (empty) spill file."""
        if not hasattr(os, "O_DIRECT"):
            return False, "O_DIRECT does not exist on this platform"
        try:
            fd = self._private.open(SPILL_FILE_NAME,
                                    os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False, f"open with O_DIRECT: {exc.strerror}"
            raise
        try:
            probe = mmap.mmap(-1, ALIGN_BYTES)  # page aligned, as O_DIRECT wants
            os.pwritev(fd, [probe], 0)
            os.preadv(fd, [probe], 0)
            return True, ""
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return False, f"O_DIRECT write/read: {exc.strerror}"
            raise
        finally:
            os.close(fd)
            os.ftruncate(self._fd, 0)

    # -- properties -------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Most bytes of extents at once (multiple of 4096)."""
        return self._alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated extents (each rounded up to 4096)."""
        with self._lock:  # a consistent read while other threads allocate
            return self._alloc.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Largest extent (bytes) that :meth:`write` can place now."""
        with self._lock:  # see used_bytes
            return self._alloc.largest_free_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether a :meth:`write` of ``nbytes`` would find room now (no :class:`SpillFull`)."""
        with self._lock:  # see used_bytes
            return nbytes == 0 or self._alloc.fits(nbytes)

    @property
    def path(self) -> str:
        """Path of the spill file."""
        return self._path

    @property
    def dir_path(self) -> str:
        """Path of the private (0700) directory holding the spill file."""
        return self._dir_path

    @property
    def o_direct(self) -> bool:
        """Whether I/O uses O_DIRECT (after the ``"auto"`` probe)."""
        return self._o_direct

    @property
    def chunk_bytes(self) -> int:
        """I/O request size and checksum granularity, bytes."""
        return self._chunk_bytes

    @property
    def checksum_name(self) -> str | None:
        """``"crc32c"`` or ``"crc32"`` (see :func:`checksum_impl`), ``None`` when off."""
        return checksum_impl()[0] if self._checksum else None

    @property
    def backend(self) -> IOBackend:
        """The I/O backend."""
        return self._backend

    @property
    def bytes_written(self) -> int:
        """Logical bytes of completed writes since construction."""
        return self._bytes_written

    @property
    def bytes_read(self) -> int:
        """Logical bytes of completed, verified reads since construction."""
        return self._bytes_read

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # -- I/O --------------------------------------------------------------------------------
    def write(self, key: Hashable, buf: torch.Tensor, nbytes: int) -> Future:
        """Spill the first ``nbytes`` of ``buf`` into a new extent.

        ``buf`` is a contiguous uint8 CPU tensor (a pool block: 4096-aligned with
        ``numel >= round_up(nbytes, 4096)``; anything else goes through a bounce buffer). It must
        stay alive and unchanged until the future is done (Note [spill buffer lifetime]).

        Returns:
            A future resolving to the :class:`Extent`. It raises :class:`SpillError` (errno,
            key, file, offset) when the write fails; the extent is then freed and the caller
            still holds the bytes.

        Raises:
            SpillFull: no free extent of ``round_up(nbytes, 4096)`` bytes.
            TypeError: ``buf`` is not a uint8 CPU tensor.
            ValueError: ``nbytes`` out of ``[0, buf.numel()]``, non-contiguous ``buf``, closed
                space.
        """
        view = host_view(buf, "SpillSpace.write buf")
        if not isinstance(nbytes, int) or not 0 <= nbytes <= view.nbytes:
            raise ValueError(f"SpillSpace.write nbytes={nbytes!r} must be an int in "
                             f"[0, buf.numel()={view.nbytes}] (key={key!r})")
        if nbytes == 0:
            return _done(Extent(0, 0, 0, ()))
        alloc_bytes = round_up(nbytes, ALIGN_BYTES)
        self._check_open()  # a forked child refuses before any lock (Note [inherited])
        with self._lock:  # see __init__
            self._check_open()
            offset = self._alloc.alloc(alloc_bytes)
            if offset is None:
                raise SpillFull(  # Note [spill errors]: raised here, not in the future
                    f"spill space full: no free extent of {alloc_bytes} bytes (used "
                    f"{self._alloc.used_bytes} of {self._alloc.capacity_bytes}, largest free run "
                    f"{self._alloc.largest_free_bytes}); raise StoreConfig.nvme_bytes or free "
                    f"spilled tensors", key=key, path=self._path, offset=None)
            op = self._new_op("write", key, offset, nbytes, alloc_bytes, buf, view.nbytes)
            self._ops.add(op)
        try:
            op.generation = self._grow_file(offset + alloc_bytes)
        except OSError as exc:
            op.fail(exc, offset)
        else:
            self._submit_chunks(op)
        self._release(op)
        return op.future

    def read(self, key: Hashable, extent: Extent, buf: torch.Tensor) -> Future:
        """Read a spilled extent back into ``buf`` and verify its checksums.

        ``buf`` is a contiguous uint8 CPU tensor with ``numel >= extent.nbytes`` (a pool block
        of ``extent.alloc_bytes`` avoids a bounce copy); keep it alive and unused until the
        future is done (Note [spill buffer lifetime]).

        Returns:
            A future resolving to ``None`` when ``buf[:extent.nbytes]`` holds the spilled bytes.
            It raises :class:`SpillCorruption` (checksum mismatch or truncated file; the offset
            is the bad chunk's) or :class:`SpillError` (I/O error), naming key, file and offset.

        Raises:
            TypeError: ``buf`` is not a uint8 CPU tensor.
            ValueError: ``buf`` too small or non-contiguous; ``extent`` not allocated here
                (freed, or from another space); closed space.
        """
        view = host_view(buf, "SpillSpace.read buf")
        if view.nbytes < extent.nbytes:
            raise ValueError(f"SpillSpace.read buf has {view.nbytes} bytes, the extent holds "
                             f"{extent.nbytes} (key={key!r})")
        if extent.nbytes == 0:
            return _done(None)
        nchunks = -(-extent.alloc_bytes // self._chunk_bytes)
        if self._checksum and len(extent.checksums) != nchunks:
            raise ValueError(f"SpillSpace.read: {extent} has {len(extent.checksums)} "
                             f"checksums, expected {nchunks} (key={key!r})")
        self._check_open()  # a forked child refuses before any lock (Note [inherited])
        cut = self._cut_error(key, extent)
        if cut is not None:
            failed: Future = Future()
            failed.set_exception(cut)
            return failed
        with self._lock:  # see __init__
            self._check_open()
            if not self._alloc.is_allocated(extent.offset, extent.alloc_bytes):
                raise ValueError(f"SpillSpace.read: {extent} is not allocated in {self._path} "
                                 f"(freed already, or from another SpillSpace) (key={key!r})")
            op = self._new_op("read", key, extent.offset, extent.nbytes, extent.alloc_bytes, buf,
                              view.nbytes)
            if self._checksum:
                op.checksums[:] = extent.checksums
            self._ops.add(op)
        self._submit_chunks(op)
        self._release(op)
        return op.future

    def free(self, extent: Extent) -> None:
        """Return ``extent``'s bytes to the free space. No-op after :meth:`close`.

        Do not free an extent while a read of it is in flight.

        Raises:
            ValueError: ``extent`` is not allocated here (double free, or another space's).
        """
        if extent.nbytes == 0 or self._inherited:
            return
        with self._lock:  # see __init__
            if self._closed:
                return
            try:
                self._alloc.free(extent.offset, extent.alloc_bytes)
            except ValueError as exc:
                raise ValueError(f"SpillSpace.free: {extent} is not allocated in {self._path} "
                                 f"(double free?): {exc}") from None

    def drop_page_cache(self) -> None:
        """Ask the kernel to drop the spill file's cached pages (for benchmarks; best effort)."""
        if hasattr(os, "posix_fadvise") and not self._closed:
            os.fsync(self._fd)  # dirty pages cannot be dropped: write them back first
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Wait for pending I/O, close the file, remove it and the private directory (and shut
        an owned backend down).

        Idempotent. Extents and futures of this space are invalid afterwards. In a child forked
        from the process that made the space it only closes the child's descriptors, taking no
        lock and waiting for nothing (Note [spill space after fork]).
        """
        if self._inherited or os.getpid() != self._pid:
            self._closed = True
            self._finalizer()
            return
        with self._lock:  # see __init__
            if self._closed:
                return
            self._closed = True
            pending = [op.future for op in self._ops]
        if os.getpid() == self._pid:
            wait(pending)  # chunk I/O still uses the descriptor; closing it first would hit a reused fd
        self._finalizer()

    def __enter__(self) -> "SpillSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SpillSpace(path={self._path!r}, capacity_bytes={self.capacity_bytes}, "
                f"used_bytes={self._alloc.used_bytes}, o_direct={self._o_direct}, "
                f"backend={self._backend.name!r}, closed={self._closed})")

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._inherited or os.getpid() != self._pid:
            raise ValueError(f"SpillSpace {self._dir_path} belongs to process {self._pid}; this "
                             f"is a child forked from it (pid {os.getpid()}), where it cannot do "
                             f"I/O; create a new space in the child")
        if self._closed:
            raise ValueError(f"SpillSpace {self._dir_path} is closed; create a new one")

    def _new_op(self, kind: str, key: Hashable, offset: int, nbytes: int, alloc_bytes: int,
                buf: torch.Tensor, buf_nbytes: int) -> _Op:
        flat = buf.reshape(-1)
        bounce = buf_nbytes < alloc_bytes or (self._o_direct and buf.data_ptr() % ALIGN_BYTES)
        nchunks = -(-alloc_bytes // self._chunk_bytes)
        if not bounce:
            return _Op(kind, key, offset, nbytes, alloc_bytes, flat[:alloc_bytes], None, nchunks)
        data = aligned_empty(alloc_bytes)
        if kind == "write":
            data[:nbytes].copy_(flat[:nbytes])
            return _Op(kind, key, offset, nbytes, alloc_bytes, data, None, nchunks)
        return _Op(kind, key, offset, nbytes, alloc_bytes, data, flat, nchunks)

    def _grow_file(self, end: int) -> int:
        """Grow the file to ``end`` bytes; return the cuts seen so far (Note [cut spill file])."""
        with self._grow_lock:  # see __init__
            self._see_cut()
            if end <= self._file_bytes:
                return len(self._cuts)
            try:
                os.posix_fallocate(self._fd, self._file_bytes, end - self._file_bytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.ftruncate(self._fd, end)  # filesystem without fallocate: sparse growth
            self._file_bytes = end
            return len(self._cuts)

    def _see_cut(self) -> None:
        """Record a cut of the file by someone else (Note [cut spill file]); the caller holds
        ``_grow_lock``. Best effort: an fstat that fails records nothing."""
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return
        if size < self._file_bytes:
            logger.warning("tiermem: the spill file %s was cut from %d to %d bytes by another "
                           "process; extents beyond that raise SpillCorruption", self._path,
                           self._file_bytes, size)
            self._cuts.append(size)
            self._file_bytes = size

    def _cut_error(self, key: Hashable, extent: Extent) -> SpillCorruption | None:
        """The error of reading ``extent`` if the file was cut below its end since its write
        began (Note [cut spill file]), else None."""
        with self._grow_lock:  # see __init__
            self._see_cut()
            cut = min(self._cuts[extent.generation:], default=None)
        if cut is None or cut >= extent.offset + extent.nbytes:
            return None
        return SpillCorruption(f"spill read of {extent.nbytes} bytes failed: spill file "
                               f"truncated: cut to {cut} bytes by someone else after this "
                               f"extent was written (Note [cut spill file])", key=key,
                               path=self._path, offset=max(cut, extent.offset))

    def _submit_chunks(self, op: _Op) -> None:
        for index, start in enumerate(range(0, op.alloc_bytes, self._chunk_bytes)):
            with op.lock:  # see _Op.__init__
                if op.error is not None:
                    return
                op.remaining += 1
            self._submit_chunk(op, index, start, 0)

    def _submit_chunk(self, op: _Op, index: int, start: int, attempt: int) -> None:
        end = min(start + self._chunk_bytes, op.alloc_bytes)
        piece = op.data[start:end]
        try:
            if op.kind == "write":
                fut = self._backend.pwrite(self._handle, piece, op.offset + start)
            else:
                fut = self._backend.pread(self._handle, piece, op.offset + start)
        except Exception as exc:  # noqa: BLE001  (e.g. backend shut down: fail this op only)
            op.fail(exc, op.offset + start)
            self._release(op)
            return
        fut.add_done_callback(
            functools.partial(self._chunk_done, op, index, start, end, attempt))

    def _chunk_done(self, op: _Op, index: int, start: int, end: int, attempt: int,
                    fut: Future) -> None:
        exc = fut.exception()
        if exc is None:
            try:
                exc = self._checksum_chunk(op, index, start, end)
            except Exception as crc_exc:  # noqa: BLE001  (a broken checksum fn fails the op)
                exc = crc_exc
        if exc is not None:
            if attempt < self._io_retries and _is_retryable(exc, op.kind):
                self._submit_chunk(op, index, start, attempt + 1)
                return
            exc_offset = getattr(exc, "offset", None)
            op.fail(exc, exc_offset if isinstance(exc_offset, int) else op.offset + start)
        self._release(op)

    def _checksum_chunk(self, op: _Op, index: int, start: int, end: int) -> Exception | None:
        if not self._checksum:
            return None
        logical_end = min(end, op.nbytes)
        value = checksum_impl()[1](op.data_np[start:logical_end])
        if op.kind == "write":
            op.checksums[index] = value
            return None
        if value != op.checksums[index]:
            return _ChecksumMismatch(op.checksums[index], value)
        return None

    def _release(self, op: _Op) -> None:
        if op.release():
            self._finish(op)

    def _finish(self, op: _Op) -> None:
        if op.error is not None:
            exc = self._spill_error(op, *op.error)
            with self._lock:  # see __init__
                if op.kind == "write" and not self._closed:
                    self._alloc.free(op.offset, op.alloc_bytes)
                self._ops.discard(op)
            op.future.set_exception(exc)
            return
        if op.user_buf is not None:
            op.user_buf[:op.nbytes].copy_(op.data[:op.nbytes])
        with self._lock:  # see __init__
            if op.kind == "write":
                self._bytes_written += op.nbytes
            else:
                self._bytes_read += op.nbytes
            self._ops.discard(op)
        if op.kind == "write":
            checksums = tuple(op.checksums) if self._checksum else ()
            op.future.set_result(Extent(op.offset, op.nbytes, op.alloc_bytes, checksums,
                                        op.generation))
        else:
            op.future.set_result(None)

    def _spill_error(self, op: _Op, cause: BaseException, file_offset: int) -> SpillError:
        what = (f"spill write of {op.nbytes} bytes" if op.kind == "write"
                else f"spill read of {op.nbytes} bytes")
        kw = dict(key=op.key, path=self._path, offset=file_offset)
        if isinstance(cause, _ChecksumMismatch):
            err = SpillCorruption(f"{what} failed: spill file corrupted: "
                                  f"{checksum_impl()[0].upper()} mismatch in the chunk at this "
                                  f"offset ({cause})", **kw)
        elif isinstance(cause, ShortReadError):
            err = SpillCorruption(f"{what} failed: spill file truncated: {cause.strerror}", **kw)
        elif isinstance(cause, OSError):
            err = SpillError(f"{what} failed: {cause.strerror or cause}", errno=cause.errno, **kw)
        else:
            err = SpillError(f"{what} failed: {type(cause).__name__}: {cause}", **kw)
        err.__cause__ = cause
        return err


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
