"""The interface every NVMe I/O backend implements.

A backend moves bytes between host buffers and spill files. Buffers are 1-D ``torch.uint8``
CPU tensors (pinned pool blocks, 4096-byte aligned when they come from the pool); offsets and
lengths are bytes. Calls return ``concurrent.futures.Future`` objects resolving to the exact
number of bytes moved; the buffer must stay alive and untouched until the future is done.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future

import torch


class IOBackend(abc.ABC):
    """Positional reads and writes on open spill files, asynchronous, thread-safe.

    A backend that runs threads records their idents in ``_idents``
    (:func:`tiermem.store.io.reaper.note_thread`), so its teardown knows when it is called on one
    of them (Note [finalizer teardown]).
    """

    name: str = "abstract"
    _idents: frozenset | set = frozenset()

    def on_own_thread(self) -> bool:
        """Whether the calling thread is one of this backend's (its I/O callbacks run there)."""
        return threading.get_ident() in self._idents

    @abc.abstractmethod
    def open(self, path: str, *, create: bool, o_direct: bool,
             dir_fd: int | None = None) -> object:
        """Open (``create``: exclusively create, mode 0600, O_NOFOLLOW) a spill file.

        With ``dir_fd`` (a directory descriptor) the file is ``os.path.basename(path)`` in that
        directory, whatever ``path`` names by now; ``path`` is only used in messages (Note
        [spill dir by fd]). Transfers go through descriptors opened here, never the path.

        Returns an opaque handle for :meth:`pwrite`/:meth:`pread`/:meth:`close_file`.

        Raises:
            OSError: the file cannot be opened (exists, permission, O_DIRECT unsupported).
        """

    @abc.abstractmethod
    def pwrite(self, handle: object, buf: torch.Tensor, offset: int) -> Future:
        """Write all of ``buf`` (uint8 CPU tensor) at byte ``offset``; the future gives the count.

        The future raises ``OSError`` (ENOSPC, EIO, short write) with the file name.
        """

    @abc.abstractmethod
    def pread(self, handle: object, buf: torch.Tensor, offset: int) -> Future:
        """Read ``buf.numel()`` bytes at ``offset`` into ``buf``; the future gives the count.

        The future raises ``OSError`` on an I/O error or a short read (end of file).
        """

    @abc.abstractmethod
    def close_file(self, handle: object) -> None:
        """Close a handle returned by :meth:`open`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Finish pending I/O and release threads. Idempotent."""
