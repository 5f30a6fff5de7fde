"""The errors of the NVMe tier's spill space (:mod:`tiermem.store.nvme`).

Note [spill errors]: errors name the key, the file and the byte offset. ``SpillFull`` (no free
extent large enough) is raised by :meth:`tiermem.store.nvme.SpillSpace.write` itself so a caller can pick another
tier at once; I/O errors arrive through the future. Idempotent positional I/O is retried
(``io_retries`` times) on EIO, on a short read and, for reads, on a checksum mismatch; ENOSPC
is never retried.

Note [cut spill file]: a spill file truncated by another process reads short only until a
later write past the cut grows it again (``pwrite`` beyond the end of a file leaves a hole that
reads as zeros); with checksums the zeros fail their CRC, without them (``checksum=False``)
they came back as data. So the space compares the file's size (``fstat``) with the bytes it
grew it to before every write and read: a smaller size is a cut, recorded (and logged) with
its size, and each extent keeps the number of cuts seen when its write began
(``Extent.generation``); a read of an extent that a later cut reached raises
``SpillCorruption`` ("truncated") without reading. A cut and the regrowing write both landing
between two checks (while that write is in flight) is not seen this way: keep checksums on.
"""

from __future__ import annotations

from typing import Hashable


class SpillError(OSError):
    """A spill write or read failed; ``key``, ``path`` (file) and ``offset`` (bytes) say where.

    ``errno`` is the OS error number when an OS error caused it, else ``None``.
    """

    def __init__(self, message: str, *, key: Hashable = None, path: str | None = None,
                 offset: int | None = None, errno: int | None = None) -> None:
        if errno is None:
            super().__init__(message)
        else:
            super().__init__(errno, message)
        self.message = message
        self.key = key
        self.path = path
        self.offset = offset

    def __str__(self) -> str:
        prefix = f"[Errno {self.errno}] " if self.errno else ""
        return f"{prefix}{self.message} (key={self.key!r}, file={self.path}, offset={self.offset})"

    def __reduce__(self):  # keyword-only arguments: pickle through a dict
        return (_rebuild_spill_error, (type(self), self.message, self.key, self.path,
                                       self.offset, self.errno))


def _rebuild_spill_error(cls, message, key, path, offset, err):
    return cls(message, key=key, path=path, offset=offset, errno=err)


class SpillCorruption(SpillError):
    """Spilled bytes failed their checksum, or the extent is truncated (short read at EOF).

    ``offset`` is the file offset of the first bad chunk (or of the missing bytes).
    """


class SpillFull(SpillError):
    """No free extent of the requested size fits in ``capacity_bytes`` (not an OS error)."""
