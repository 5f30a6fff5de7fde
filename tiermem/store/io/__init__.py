"""NVMe I/O backends behind one interface (:class:`~tiermem.store.io.base.IOBackend`).

- ``"posix"``: :class:`~tiermem.store.io.posix.PosixBackend`, a thread pool doing
  ``os.pwritev``/``os.preadv`` (the default on machines without a CUDA driver).
- ``"kvikio"``: :class:`~tiermem.store.io.kvikio_backend.KvikioBackend`, kvikio's ``CuFile``
  (GPUDirect Storage or its POSIX compat mode); needs kvikio and ``libcuda.so.1``.
- ``"aiofiles"``: :class:`~tiermem.store.io.aio.AiofilesBackend`, aiofiles on a private
  asyncio loop.
- ``"auto"``: kvikio when :func:`kvikio_usable`, else posix.
"""

from __future__ import annotations

from .base import IOBackend
from .kvikio_backend import kvikio_usable
from .posix import PosixBackend, ShortReadError

BACKENDS = ("auto", "posix", "kvikio", "aiofiles")
"""Valid values of ``StoreConfig.io_backend``."""


def resolve_backend_name(name: str) -> str:
    """Return the concrete backend ``name`` stands for (``"auto"`` -> ``"kvikio"``/``"posix"``).

    Raises:
        ValueError: unknown name (lists the choices), or ``"kvikio"`` when it is not usable
            here (gives the reason and suggests ``io_backend='posix'``).
    """
    if name not in BACKENDS:
        raise ValueError(f"StoreConfig.io_backend={name!r} is not one of "
                         f"{', '.join(map(repr, BACKENDS))}")
    if name == "auto":
        return "kvikio" if kvikio_usable()[0] else "posix"
    if name == "kvikio":
        ok, reason = kvikio_usable()
        if not ok:
            raise ValueError(f"StoreConfig.io_backend='kvikio' is not usable here: {reason}; "
                             f"fix: set io_backend='posix' (or 'auto', which falls back to it)")
    return name


def make_backend(name: str, threads: int) -> IOBackend:
    """Create the I/O backend ``name`` (one of :data:`BACKENDS`) with ``threads`` threads.

    The caller owns the backend and calls :meth:`IOBackend.shutdown` when done.

    Raises:
        ValueError: unknown ``name``; ``"kvikio"`` not usable here (the message says why and
            suggests ``io_backend='posix'``); ``threads`` < 1.
    """
    name = resolve_backend_name(name)
    if name == "posix":
        return PosixBackend(threads)
    if name == "aiofiles":
        from .aio import AiofilesBackend  # noqa: PLC0415  (starts a thread only when asked for)

        return AiofilesBackend(threads)
    from .kvikio_backend import KvikioBackend  # noqa: PLC0415

    return KvikioBackend(threads)


__all__ = ["BACKENDS", "IOBackend", "PosixBackend", "ShortReadError", "kvikio_usable",
           "make_backend", "resolve_backend_name"]
