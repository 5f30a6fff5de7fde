"""What a checkpoint may hold: exactly what ``torch.load(weights_only=True)`` reads back.

Note [checkpoint payload types]
``load_checkpoint`` unpickles with ``torch.load(weights_only=True)`` (:func:`weights_only_load`,
the one reader), which refuses every global outside torch's allow-list: tensors, dicts, lists,
tuples, sets, ``OrderedDict``/``Counter``, str, int, float, bool, None, bytes, complex,
``torch.Size``/``dtype``/``device``. ``torch.save`` writes anything. So a save of, say, a
``numpy.float64`` loss would replace the last good checkpoint with one that no load accepts.
Every save therefore checks its payload against that same reader, twice, before the target is
touched:

1. :func:`check_payload` walks the object (before any byte is written) and names the first
   object load would refuse by its key path (``extra['args']``), its type and the fix. It has
   no allow-list of its own: it descends only into exact ``dict``/``list``/``tuple``/``set``/
   ``OrderedDict``/``Counter`` (each of which the reader accepts), skips exact str, int, float,
   bool, None, bytes and plain tensors, and asks :func:`refusal` (a ``torch.save`` to memory and
   :func:`weights_only_load` back) about everything else.
2. After the file is written and fsync-ed, before the rename, :func:`weights_only_load` reads
   the file itself (through ``mmap``, so tensor bytes are not read): anything the walk could not
   see is refused too. This second check is the guarantee; the first gives the message.

Nothing is converted silently: numpy scalars and arrays (``np.random.get_state()`` holds one)
are refused with the conversion to use (``x.item()``, ``torch.from_numpy(x)``) rather than
allow-listed for loading, because numpy's reconstructors are not on torch's list for a reason
(an array of dtype object unpickles arbitrary objects), and a loaded value of another type than
the one saved would be a surprise of its own.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from typing import Any

import torch

_CONTAINERS = (dict, list, tuple, set, collections.OrderedDict, collections.Counter)
"""Exact container types the weights-only reader accepts (their elements are checked too)."""
_PLAIN = (str, int, float, bool, type(None), bytes)
"""Exact types the reader accepts without asking it (pickle opcodes, no global)."""


def weights_only_load(f: Any, *, mmap: bool = False) -> Any:
    """``torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)``: the one reader
    of checkpoint payloads (loads and the checks of saves).

    Raises:
        pickle.UnpicklingError: the file holds an object the reader refuses.
        RuntimeError, EOFError, ValueError, KeyError: not a readable torch archive.
    """
    return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)


def refusal_reason(exc: BaseException) -> str:
    """The line of a weights-only ``UnpicklingError`` that says what was refused."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    boilerplate = ("Weights only load failed", "(1)", "(2)", "Check the documentation")
    kept = [ln for ln in lines if not ln.startswith(boilerplate)] or lines
    reason = kept[0] if kept else type(exc).__name__
    for line in lines:
        if line.startswith("WeightsUnpickler error:"):
            reason = line[len("WeightsUnpickler error:"):].strip()
    return reason.split(". Please use", 1)[0].rstrip(".")  # (allow-listing is not the fix)


def refusal(obj: Any) -> str | None:
    """Why :func:`weights_only_load` refuses ``obj`` after ``torch.save`` (None: it reads it).

    Raises:
        Exception: whatever ``torch.save`` raises for an object it cannot pickle at all.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        weights_only_load(buf)
    except pickle.UnpicklingError as exc:
        return refusal_reason(exc)
    return None


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else \
        f"{cls.__module__}.{cls.__qualname__}"


def _article(name: str) -> str:
    return "an" if name[:1].lower() in "aeiou" else "a"


def _fix(obj: Any, where: str) -> str:
    """The conversion to save instead of ``obj`` (found at ``where``)."""
    import argparse  # noqa: PLC0415  (cheap; only on the error path)
    import datetime  # noqa: PLC0415
    from collections.abc import Mapping  # noqa: PLC0415

    module = type(obj).__module__.split(".")[0]
    if isinstance(obj, argparse.Namespace):
        return f"save vars({where}) (a dict)"
    if module == "numpy":
        if type(obj).__name__ == "ndarray":
            return f"save torch.from_numpy({where}) (a tensor; .numpy() converts it back)"
        return f"save {where}.item() (a Python int, float or bool)"
    if isinstance(obj, torch.Tensor):
        return (f"save a plain tensor without attributes or subclass "
                f"({where}.detach().as_subclass(torch.Tensor), a new tensor) and the "
                f"attributes as separate entries")
    if isinstance(obj, os.PathLike):
        return f"save str({where})"
    if isinstance(obj, (datetime.date, datetime.time)):
        return f"save {where}.isoformat() (or a timestamp as a float)"
    if isinstance(obj, datetime.timedelta):
        return f"save {where}.total_seconds()"
    if isinstance(obj, Mapping):
        return f"save dict({where})"
    if isinstance(obj, frozenset):
        return f"save set({where})"
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return f"save {where}._asdict() (a dict) or tuple({where})"
    if isinstance(obj, (tuple, list, set, str, int, float, bytes)):
        base = next(t for t in (bool, int, float, str, bytes, tuple, list, set)
                    if isinstance(obj, t))
        return f"save {base.__name__}({where})"
    return ("convert it to tensors, dicts, lists, tuples, sets, str, int, float, bool or None "
            "(or register its class with torch.serialization.add_safe_globals in every "
            "process that saves and loads)")


def _message(caller: str, where: str, what: str, obj: Any, reason: str, expr: str) -> str:
    name = _type_name(obj)
    found = f"is {_article(name)} {name}" if what == "is" else \
        f"has a key {obj!r} of type {name}"
    return (f"{caller}: {where} {found}, which load_checkpoint would "
            f"refuse (torch.load(weights_only=True): {reason}); nothing was written; "
            f"fix: {_fix(obj, expr)}")


def check_payload(obj: Any, label: str, caller: str = "save_checkpoint") -> None:
    """Refuse ``obj`` (named ``label`` in messages, e.g. ``"extra"``) when it holds anything
    :func:`weights_only_load` would refuse; see Note [checkpoint payload types].

    Raises:
        TypeError: one line naming ``caller``, the key path (``extra['args']``), the type and
            the fix.
    """
    # (object, where it is, the expression the fix names, "is" or "has a key")
    stack: list[tuple[Any, str, str, str]] = [(obj, label, label, "is")]
    seen: set[int] = set()
    while stack:
        item, where, expr, what = stack.pop()
        cls = type(item)
        if cls in _PLAIN:
            continue
        if cls in (torch.Tensor, torch.nn.Parameter) and not getattr(item, "__dict__", None):
            continue
        if cls in _CONTAINERS and what == "is":
            if id(item) in seen:  # shared or cyclic: checked once
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                for key, value in reversed(list(item.items())):
                    stack.append((value, f"{where}[{key!r}]", f"{expr}[{key!r}]", "is"))
                    stack.append((key, where, "key", "has a key"))
            elif isinstance(item, set):
                stack.extend((e, f"{where}{{...}}", "element", "is") for e in item)
            else:
                stack.extend((item[i], f"{where}[{i}]", f"{expr}[{i}]", "is")
                             for i in reversed(range(len(item))))
            continue
        reason = refusal(item)
        if reason is not None:
            raise TypeError(_message(caller, where, what, item, reason, expr))
