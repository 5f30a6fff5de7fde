"""The configuration vocabulary: the names tiermem accepts and the checks every entry point uses.

The config dataclasses (:mod:`tiermem.config`), :class:`tiermem.optim.HybridAdam`,
:func:`tiermem.offload.offload_activations` and the spill space validate their arguments with
the functions below, so one value gets one spelling and one error everywhere. Every check
raises a one-line error naming the field, the value and the fix; ``who`` is the prefix that
names the owner *with its separator*: ``"optimizer."`` for a YAML section,
``"StoreConfig."`` for a dataclass, ``"HybridAdam: "`` for a call.

This module imports nothing from tiermem (every tiermem module may import it).
"""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

import torch

TIERS = ("gpu", "cpu", "nvme")
"""Tier names of a TierStore, fastest first. Victims move down this list."""
OFFLOAD_TIERS = ("cpu", "nvme")
"""Where offloaded activations go (``offload_activations(tier=...)``)."""
STATE_TIERS = ("cpu", "nvme", "split")
"""Where HybridAdam's offloaded state lives: pinned RAM, NVMe, or RAM up to the store's cpu
budget and the rest on NVMe."""
IO_BACKENDS = ("auto", "posix", "kvikio", "aiofiles")
"""NVMe I/O backends (``StoreConfig.io_backend``); see :mod:`tiermem.store.io` for ``"auto"``."""
POLICIES = ("lru", "trace")
"""Eviction policies by name (``StoreConfig.policy``)."""
PLACEMENTS = ("trace", "given")
"""``HybridAdam(placement=...)``: which elements keep their state on the GPU."""
PARAM_SYNCS = ("step", "forward")
"""``HybridAdam(param_sync=...)``: when the updated offloaded params are waited for."""
AUTO_BOOL = (True, False, "auto")
"""Switches that may also be left to the library (``pin_memory``, ``o_direct``)."""

DTYPE_SPELLINGS = {
    "float32": "float32", "fp32": "float32", "torch.float32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
    "float16": "float16", "fp16": "float16", "torch.float16": "float16",
}
"""Every accepted spelling of a floating-point dtype -> its canonical (torch) name."""
MODEL_DTYPES = ("float32", "bfloat16")
"""Parameter dtypes of the training loops (float16 would need loss scaling: not offered)."""
MOMENTS_DTYPES = ("float32", "bfloat16")
"""Dtypes of HybridAdam's moments (``moments_dtype``: the GPU side's and the offloaded side's)."""

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = _SHORT.maxfrozenset = _SHORT.maxdeque = 6
_SHORT.maxdict = 6
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 160


def short_repr(value: Any, max_chars: int = 200) -> str:
    """``repr(value)`` cut to at most ``max_chars`` characters, at bounded cost.

    Note [bounded repr]: an error message shows the value it refuses, but a value from a user's
    YAML may be a list nested many levels deep that shares its items (Note [bounded YAML] in
    tiermem/_yaml.py), whose full ``repr`` takes minutes and gigabytes. ``reprlib`` looks at
    most 6 items per level and 3 levels deep, so the cost and the length are bounded whatever
    the value; small values (numbers, names, short strings) print as ``repr`` prints them.

    Raises:
        nothing: a ``repr`` that fails prints as ``<TYPE>``.
    """
    try:
        text = _SHORT.repr(value)
    except Exception:  # a failing __repr__, an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def _tail(fix: str) -> str:
    return f"; {fix}" if fix else ""


def _is_choice(value: Any, choice: Any) -> bool:
    """``value == choice``, but a bool only matches a bool (``1`` is not ``True``)."""
    if isinstance(choice, bool) or isinstance(value, bool):
        return value is choice
    return type(value) is type(choice) and value == choice


def check_choice(who: str, field: str, value: Any, choices: tuple, fix: str = "") -> Any:
    """Return ``value`` if it is one of ``choices`` (a bool matches only a bool).

    Args:
        who: prefix naming the owner with its separator (``"optimizer."``, ``"HybridAdam: "``).
        field: the argument's name.
        value: what was given.
        choices: the accepted values.
        fix: what each choice means or what to do (appended after ``;``).

    Raises:
        ValueError: ``value`` is not one of ``choices`` (the message lists them).
    """
    if not any(_is_choice(value, c) for c in choices):
        raise ValueError(f"{who}{field}={short_repr(value)} is not one of "
                         f"{', '.join(map(repr, choices))}{_tail(fix)}")
    return value


def check_bool(who: str, field: str, value: Any) -> bool:
    """Return ``value`` if it is ``True`` or ``False``.

    Raises:
        ValueError: anything else (``1``, ``"yes"``, ``None``).
    """
    return check_choice(who, field, value, (True, False), "give a bool (true or false in YAML)")


def check_number(who: str, field: str, value: Any, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False, high_open: bool = False,
                 fix: str = "") -> float:
    """Return ``value`` if it is a real number (not a bool) within the given bounds.

    Args:
        low, high: bounds; ``None``: unbounded on that side.
        low_open, high_open: the bound itself is excluded (``> low``, ``< high``).
        fix: what the number means or what to do (appended after ``;``).

    Raises:
        TypeError: not an int or float (or a bool).
        ValueError: ``nan`` or outside the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}{field} must be a number, got {type(value).__name__} "
                        f"{short_repr(value)}{_tail(fix)}")
    if value != value:
        raise ValueError(f"{who}{field}={short_repr(value)} is not a number{_tail(fix)}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{who}{field}={short_repr(value)} must be "
                         f"{'>' if low_open else '>='} {low}{_tail(fix)}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{who}{field}={short_repr(value)} must be "
                         f"{'<' if high_open else '<='} {high}{_tail(fix)}")
    return value


def check_fraction(who: str, field: str, value: Any, meaning: str = "") -> float:
    """Return ``value`` as a float if it is a number in [0.0, 1.0].

    Args:
        meaning: what the fraction is of (appended after ``;``).

    Raises:
        TypeError: not an int or float (or a bool).
        ValueError: outside [0.0, 1.0] or ``nan``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}{field} must be a number in [0.0, 1.0], got "
                        f"{type(value).__name__} {short_repr(value)}{_tail(meaning)}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{who}{field}={short_repr(value)} is outside [0.0, 1.0]"
                         f"{_tail(meaning)}")
    return float(value)


def check_int(who: str, field: str, value: Any, *, low: int = 1, unit: str = "",
              fix: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) >= ``low``.

    Args:
        low: the least accepted value.
        unit: what the int counts (``"bytes"``, ``"threads"``), shown in brackets.
        fix: what to do (appended after ``;``).

    Raises:
        TypeError: not an int (or a bool).
        ValueError: less than ``low``.
    """
    what = f"an int >= {low}" + (f" ({unit})" if unit else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}{field} must be {what}, got {type(value).__name__} "
                        f"{short_repr(value)}{_tail(fix)}")
    if value < low:
        raise ValueError(f"{who}{field}={short_repr(value)} must be {what}{_tail(fix)}")
    return value


def check_aligned(who: str, field: str, value: Any, align_bytes: int, why: str) -> int:
    """Return ``value`` if it is a positive int multiple of ``align_bytes``.

    Args:
        align_bytes: the alignment in bytes.
        why: the reason for the alignment, shown in brackets (``"O_DIRECT alignment"``).

    Raises:
        TypeError: not an int (or a bool).
        ValueError: not positive, or not a multiple of ``align_bytes``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}{field} must be a positive multiple of {align_bytes} bytes "
                        f"({why}), got {type(value).__name__} {short_repr(value)}")
    if value < align_bytes or value % align_bytes:
        raise ValueError(f"{who}{field}={short_repr(value)} must be a positive multiple of "
                         f"{align_bytes} ({why})")
    return value


def check_device(who: str, field: str, value: Any) -> str:
    """Return ``value`` if it names a device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: anything else.
    """
    if not (isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", value)):
        raise ValueError(f"{who}{field}={short_repr(value)} is not 'auto', 'cpu', 'cuda' or "
                         f"'cuda:N'; auto is CUDA when present, else the CPU")
    return value


def resolve_device(value: Any, field: str = "device") -> torch.device:
    """The ``torch.device`` that a device name means here: ``"auto"`` is the current CUDA device
    when CUDA is present, else the CPU; ``"cuda"`` gets the current device's index.

    Args:
        value: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        field: the setting's name for the error message (``"StoreConfig.device"``).

    Raises:
        ValueError: CUDA asked for but not available here.
    """
    if str(value) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(value)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{field}={str(value)!r} but CUDA is not available here; use "
                             f"{field}='auto' or 'cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def dtype_name(who: str, field: str, value: Any, choices: tuple = MODEL_DTYPES) -> str:
    """Return the canonical name (``"float32"``, ``"bfloat16"``) of a dtype given in any spelling.

    Args:
        value: a ``torch.dtype`` or a string of :data:`DTYPE_SPELLINGS` (``"bf16"``,
            ``"bfloat16"``, ``"torch.bfloat16"``, ``"fp32"``, ``"float32"``, ...; any case).
        choices: the canonical names accepted here.

    Raises:
        ValueError: an unknown spelling, or a dtype that is not one of ``choices``.
    """
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    elif isinstance(value, str):
        name = DTYPE_SPELLINGS.get(value.strip().lower(), value)
    else:
        name = repr(value)
    if name not in choices:
        spell = ", ".join(s for s, canon in DTYPE_SPELLINGS.items() if canon in choices)
        raise ValueError(f"{who}{field}={short_repr(value)} is not a supported dtype; use one "
                         f"of {spell} (or the torch.dtype)")
    return name


def parse_dtype(who: str, field: str, value: Any, choices: tuple = MODEL_DTYPES) -> torch.dtype:
    """Return the ``torch.dtype`` of a dtype given in any spelling (see :func:`dtype_name`).

    Raises:
        ValueError: an unknown spelling, or a dtype that is not one of ``choices``.
    """
    return getattr(torch, dtype_name(who, field, value, choices))


def parse_bytes(value: int | float | str, field: str) -> int:
    """Return a byte count from an int or a string such as ``"1.5GiB"``.

    Args:
        value: bytes as an int (or integral float), or a number with a unit (B, KB, MB, GB, TB,
            KiB, MiB, GiB, TiB; case-insensitive).
        field: the field's full name (``"StoreConfig.cpu_bytes"``), used in error messages.

    Raises:
        ValueError: unparsable string, unknown unit, negative, non-integral or non-finite
            (``inf``, ``nan``, ``"1e400"``) count.
        TypeError: value is neither a number nor a string.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got bool "
                        f"{short_repr(value)}")
    original = value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{field}={short_repr(value)} is not a byte size; write an integer number of "
                f"bytes or a number with a unit such as '512MiB' or '4GB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not isinstance(value, (int, float)):
        raise TypeError(f"{field} must be a byte count (int or '4GiB'), got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{field}={short_repr(original)} is not a finite byte size; "
                         f"write an integer number of bytes or a number with a unit such as "
                         f"'512MiB' or '4GB'")
    if value < 0:
        raise ValueError(f"{field}={short_repr(value)} is negative; a budget is a byte "
                         f"count >= 0 (0 disables the tier)")
    if float(value) != int(value):
        raise ValueError(f"{field}={short_repr(value)} is not a whole number of bytes")
    return int(value)


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units); None -> ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def gib(nbytes: float | None, digits: int = 2) -> str:
    """``nbytes`` as GiB (2^30 bytes) with ``digits`` decimals and no unit; None -> ``"-"``."""
    return "-" if nbytes is None else f"{nbytes / 2**30:.{digits}f}"


def mib(nbytes: float | None, digits: int = 2) -> str:
    """``nbytes`` as MiB (2^20 bytes) with ``digits`` decimals and no unit; None -> ``"-"``."""
    return "-" if nbytes is None else f"{nbytes / 2**20:.{digits}f}"
