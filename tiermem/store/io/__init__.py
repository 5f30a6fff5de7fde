"""NVMe I/O backends behind one interface (:class:`~tiermem.store.io.base.IOBackend`).

- ``"posix"``: :class:`~tiermem.store.io.posix.PosixBackend`, a thread pool doing
  ``os.pwritev``/``os.preadv``.
- ``"kvikio"``: :class:`~tiermem.store.io.kvikio_backend.KvikioBackend`, kvikio's ``CuFile``
  on the pinned host buffers the spill path hands every backend, i.e. kvikio's own POSIX reads
  and writes on its thread pool (never GPUDirect Storage: no device buffer reaches it); needs
  kvikio and ``libcuda.so.1``.
- ``"aiofiles"``: :class:`~tiermem.store.io.aio.AiofilesBackend`, aiofiles on a private
  asyncio loop.
- ``"auto"``: posix. kvikio only when asked for by name: on the H200 machine the POSIX pool
  measured at least as fast at 4 threads (docs/benchmarks_archive.md, "NVMe spill"), and no
  measurement shows kvikio ahead on this path.

The choice is logged (INFO) on the ``tiermem`` logger.
"""

from __future__ import annotations

import logging

from ...names import IO_BACKENDS
from .base import IOBackend
from .kvikio_backend import kvikio_usable
from .posix import PosixBackend, ShortReadError

BACKENDS = IO_BACKENDS
"""Valid values of ``StoreConfig.io_backend`` (:data:`tiermem.names.IO_BACKENDS`)."""

AUTO_BACKEND = "posix"
"""What ``"auto"`` resolves to (see the module docstring for the measurement behind it)."""

logger = logging.getLogger("tiermem")


def resolve_backend_name(name: str) -> str:
    """Return the concrete backend ``name`` stands for (``"auto"`` -> ``"posix"``).

    Raises:
        ValueError: unknown name (lists the choices), or ``"kvikio"`` when it is not usable
            here (gives the reason and suggests ``io_backend='posix'``).
    """
    if name not in BACKENDS:
        raise ValueError(f"StoreConfig.io_backend={name!r} is not one of "
                         f"{', '.join(map(repr, BACKENDS))}")
    if name == "auto":
        return AUTO_BACKEND
    if name == "kvikio":
        ok, reason = kvikio_usable()
        if not ok:
            raise ValueError(f"StoreConfig.io_backend='kvikio' is not usable here: {reason}; "
                             f"fix: set io_backend='posix' (or 'auto', which is posix)")
    return name


def make_backend(name: str, threads: int) -> IOBackend:
    """Create the I/O backend ``name`` (one of :data:`BACKENDS`) with ``threads`` threads.

    The caller owns the backend and calls :meth:`IOBackend.shutdown` when done.

    Raises:
        ValueError: unknown ``name``; ``"kvikio"`` not usable here (the message says why and
            suggests ``io_backend='posix'``); ``threads`` < 1.
    """
    resolved = resolve_backend_name(name)
    if name == "auto":
        logger.info("NVMe I/O backend: %s (io_backend='auto'; kvikio only when named: it "
                    "measured no faster on pinned host buffers)", resolved)
    else:
        logger.info("NVMe I/O backend: %s (io_backend=%r)", resolved, name)
    name = resolved
    if name == "posix":
        return PosixBackend(threads)
    if name == "aiofiles":
        from .aio import AiofilesBackend  # noqa: PLC0415  (starts a thread only when asked for)

        return AiofilesBackend(threads)
    from .kvikio_backend import KvikioBackend  # noqa: PLC0415

    return KvikioBackend(threads)


__all__ = ["AUTO_BACKEND", "BACKENDS", "IOBackend", "PosixBackend", "ShortReadError",
           "kvikio_usable", "make_backend", "resolve_backend_name"]
