"""Loader for tiermem's native core, ``_tiermem_native.so`` (plain C, loaded with ctypes).

The library is built by ``pip install`` (see ``setup.py``) next to this file. It links against
neither Python nor libtorch, so one build serves every torch version. When it is missing (no C
compiler at install time, or an unusual platform) :func:`available` is ``False`` and callers
use their torch fallbacks; :func:`load_error` says why.

Threads: the library's OpenMP runtime is the ``libgomp.so.1`` torch's wheel already loaded into
the process (same soname), but OpenMP's thread-count setting is per calling thread, so callers
pass ``torch.get_num_threads()`` explicitly (:func:`num_threads`) rather than rely on it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import zlib
from pathlib import Path
from typing import Any

__all__ = [
    "ABI_VERSION",
    "DTYPE_CODES",
    "available",
    "load_error",
    "lib",
    "crc32c",
    "checksum_algorithm",
    "num_threads",
    "adam_isa",
    "set_adam_isa",
]

#: Must equal TM_ABI_VERSION in native/tiermem_native.h; a stale build is refused.
ABI_VERSION = 2

#: dtype codes of native/tiermem_native.h (enum tm_dtype), by torch dtype name.
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
DTYPE_NONE = 3

#: Error codes of tm_adam_step (enum tm_err).
ERRORS = {-1: "unsupported dtype code", -2: "negative numel", -3: "null pointer",
          -4: "step < 1", -5: "bad sum placement"}

#: Kernel instruction-set levels (enum tm_isa).
ISA_NAMES = {0: "default", 1: "avx2", 2: "avx512"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_loaded = False
_zlib_noted = False

logger = logging.getLogger("tiermem")


def _candidates() -> list[Path]:
    here = Path(__file__).parent
    env = os.environ.get("TIERMEM_NATIVE_LIB")  # explicit override, e.g. a debug build
    paths = [Path(env)] if env else []
    paths.append(here / "_tiermem_native.so")
    paths.extend(sorted(here.glob("_tiermem_native*.so")))
    seen: list[Path] = []
    for p in paths:
        if p not in seen:
            seen.append(p)
    return seen


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_i64, c_dbl, c_vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    lib.tm_abi_version.argtypes = []
    lib.tm_abi_version.restype = c_int
    lib.tm_adam_step.argtypes = [
        c_vp, c_vp, c_int, c_vp, c_vp, c_int, c_vp, c_int,  # pointers and dtype codes
        c_i64, c_i64,  # numel, step
        c_dbl, c_dbl, c_dbl, c_dbl, c_dbl,  # lr, beta1, beta2, eps, weight_decay
        c_int, c_int, c_int,  # adamw, maximize, num_threads
    ]
    lib.tm_adam_step.restype = c_int
    lib.tm_adam_step_sum.argtypes = lib.tm_adam_step.argtypes + [
        c_i64, c_i64, ctypes.POINTER(ctypes.c_uint64)]  # sum_phase, sum_weighted, sum_out
    lib.tm_adam_step_sum.restype = c_int
    lib.tm_adam_isa.argtypes = []
    lib.tm_adam_isa.restype = c_int
    lib.tm_adam_set_isa.argtypes = [c_int]
    lib.tm_adam_set_isa.restype = c_int
    lib.tm_omp_max_threads.argtypes = []
    lib.tm_omp_max_threads.restype = c_int
    for name in ("tm_crc32c", "tm_crc32c_sw"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_uint32, c_vp, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
    lib.tm_crc32c_hw.argtypes = []
    lib.tm_crc32c_hw.restype = c_int


def _load() -> ctypes.CDLL | None:
    global _lib, _error, _loaded
    with _lock:
        if _loaded:
            return _lib
        errors = []
        for path in _candidates():
            if not path.is_file():
                continue
            try:
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                version = lib.tm_abi_version()
            except (OSError, AttributeError) as exc:
                errors.append(f"{path}: {exc}")
                continue
            if version != ABI_VERSION:
                errors.append(f"{path}: ABI version {version}, expected {ABI_VERSION} "
                              "(stale build: rerun `pip install --no-build-isolation -e .`)")
                continue
            _lib = lib
            break
        if _lib is None:
            _error = "; ".join(errors) or (
                f"_tiermem_native*.so not found in {Path(__file__).parent} (the native build was "
                "skipped at install time; rerun `pip install --no-build-isolation -e .` with a C "
                "compiler to build it)")
            logger.warning("native core unavailable: %s. The CPU Adam step falls back to torch's "
                           "fused kernel and spill checksums to zlib's CRC-32", _error)
        else:
            logger.info("native core loaded: %s (Adam kernel %s)", _lib._name,
                        ISA_NAMES.get(_lib.tm_adam_isa(), "?"))
        _loaded = True
        return _lib


def lib() -> ctypes.CDLL | None:
    """The loaded native library, or ``None`` when it is unavailable (see :func:`load_error`)."""
    return _load()


def available() -> bool:
    """Whether the native library is built and loadable.

    Returns:
        ``True`` when ``_tiermem_native.so`` was found, loaded and has the expected ABI version.
    """
    return _load() is not None


def load_error() -> str | None:
    """Why the native library is unavailable, or ``None`` when it loaded."""
    _load()
    return _error


def num_threads() -> int:
    """Threads the native kernels use by default: ``torch.get_num_threads()``.

    Returns:
        The intra-op thread count torch uses (set with ``torch.set_num_threads``); 1 when torch
        is not importable.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 1
    return max(1, int(torch.get_num_threads()))


def adam_isa() -> str:
    """Instruction set of the Adam kernel in use: ``"avx512"``, ``"avx2"`` or ``"default"``.

    Raises:
        RuntimeError: if the native library is unavailable.
    """
    native = _require()
    return ISA_NAMES[native.tm_adam_isa()]


def set_adam_isa(isa: str | None) -> str:
    """Force the Adam kernel's instruction set (for tests and benchmarks).

    Args:
        isa: ``"avx512"``, ``"avx2"``, ``"default"``, or ``None`` for the best the CPU supports.
            A level the CPU lacks falls back to the best supported one.

    Returns:
        The level now in use.

    Raises:
        ValueError: if ``isa`` is not one of the names above.
        RuntimeError: if the native library is unavailable.
    """
    codes = {name: code for code, name in ISA_NAMES.items()}
    if isa is not None and isa not in codes:
        raise ValueError(f"isa={isa!r} is not one of {sorted(codes)} or None")
    native = _require()
    return ISA_NAMES[native.tm_adam_set_isa(-1 if isa is None else codes[isa])]


def _require() -> ctypes.CDLL:
    native = _load()
    if native is None:
        raise RuntimeError(f"tiermem native library unavailable: {_error}")
    return native


def _buffer_address(buf: Any) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a contiguous CPU buffer."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"buf is on device {buf.device}; crc32c needs a CPU tensor "
                             "(copy it with .cpu() first)")
        if not buf.is_contiguous():
            raise ValueError("buf is a non-contiguous tensor; pass buf.contiguous()")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0, len(buf), buf
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"buf of type {type(buf).__name__} is neither a torch tensor nor a "
                        "buffer (bytes, bytearray, numpy array, mmap, memoryview)") from None
    if not view.c_contiguous:
        raise ValueError("buf is a non-contiguous buffer; pass a C-contiguous copy")
    import numpy as np

    arr = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                        dtype=np.uint8)
    return (arr.ctypes.data if arr.size else 0), view.nbytes, (arr, view)


def checksum_algorithm() -> str:
    """Name of the checksum :func:`crc32c` computes: ``"crc32c"`` (native) or ``"crc32"``.

    Without the native library :func:`crc32c` falls back to zlib's CRC-32 (a different
    polynomial). Spill-file checksums never outlive the process that wrote them, so writer and
    reader always agree; do not persist these values across processes.
    """
    return "crc32c" if available() else "crc32"


def _note_zlib_fallback() -> None:
    """Log once (WARNING, ``tiermem`` logger) that checksums are zlib's CRC-32, not CRC-32C."""
    global _zlib_noted
    if not _zlib_noted:
        _zlib_noted = True
        logger.warning("checksums fall back from CRC-32C to zlib's CRC-32: the native library is "
                       "unavailable (%s)", _error or "not loaded")


def crc32c(buf: Any, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a contiguous CPU buffer, chainable.

    ``crc32c(b, crc32c(a)) == crc32c(a + b)``; ``crc32c(b"123456789") == 0xE3069283``. Uses
    the SSE4.2 instruction (~10+ GB/s per core) when the CPU has it, else slicing-by-8 tables.
    Without the native library it falls back to ``zlib.crc32`` (see :func:`checksum_algorithm`).

    Args:
        buf: a contiguous CPU torch tensor (its ``numel * element_size`` bytes), ``bytes``,
            ``bytearray``, numpy array, mmap or anything exposing a C-contiguous buffer.
        crc: the value returned for the preceding bytes (0 to start).

    Returns:
        The CRC as an unsigned 32-bit int.

    Raises:
        TypeError: if ``buf`` is not a tensor nor a buffer.
        ValueError: if ``buf`` is not on the CPU, not contiguous, or ``crc`` is out of
            [0, 2**32).
    """
    if not 0 <= int(crc) < 2**32:
        raise ValueError(f"crc={crc} is out of [0, 2**32); pass a previous crc32c() result")
    addr, nbytes, keep = _buffer_address(buf)
    native = _load()
    if native is None:
        _note_zlib_fallback()
        if nbytes == 0:
            return int(crc)
        return zlib.crc32((ctypes.c_char * nbytes).from_address(addr), int(crc)) & 0xFFFFFFFF
    value = native.tm_crc32c(int(crc), addr, nbytes)
    del keep
    return int(value)
