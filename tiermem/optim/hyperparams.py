"""Checks of HybridAdam's hyper-parameters and gradients, at construction and at every use.

Note [finite hyper-parameters]: a scheduler or the user may set any value in ``param_groups``
between steps, and one non-finite ``lr`` (or betas, eps, weight_decay, ``max_grad_norm``)
turns every offloaded parameter into NaN on the next step, with no error. So the values are
checked where they are read: at construction, in ``step()`` before anything is stepped, and by
the chunk worker when it takes a group's live values during backward (overlap, before
``step()``). ``amsgrad=True`` is refused the same way: HybridAdam does not implement it, and
stepping without it would silently differ from the state it was given.

Note [late hyper-parameters]: torch.optim.AdamW steps with the ``param_groups`` values it finds
at ``step()``. A loop may set them after backward and before ``step()`` (Karpathy's
build-nanogpt sets ``lr`` from its schedule there), while with ``overlap=True`` HybridAdam's
worker steps offloaded chunks during backward with the values live then (Note [frozen
hyper-parameters] in step_state.py): those chunks were silently stepped with the previous
step's learning rate (a 5-step probe: 4.6e-3 off AdamW). Now every value a chunk stepped before
``step()`` read (:data:`STEP_KEYS`) is recorded, and so are the values at the step's first
gradient hook; ``step()`` compares both with its own (:func:`hp_differences`):
- values changed after backward began, no chunk stepped with the old ones (the first step,
  which only records the gradients' order; held chunks): the step is exact, and from then on
  HybridAdam holds every offloaded chunk until ``step()`` (as with clipping without
  speculation; logged once at WARNING with the fix that gives the overlap back: set the values
  before the forward, e.g. a scheduler's ``step()`` after ``opt.step()``);
- a chunk was stepped with values ``step()`` does not have (a loop that changes them after
  backward only later in training): that step is refused in one line naming the group, the
  field and both values, and abandoned (speculated chunks go back; chunks stepped without a
  rollback copy cannot: the message says to restart from a checkpoint), and the hold begins.
tests/optim/test_late_hyperparams.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_FIELDS = ("lr", "eps", "weight_decay")
STEP_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw", "maximize")
"""The hyper-parameters an offloaded chunk's step reads (Note [late hyper-parameters])."""


def _same(a: Any, b: Any) -> bool:
    """Whether two hyper-parameter values are equal (tensors: same values; tuples and lists
    elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.to(a.dtype).cpu()))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def hp_differences(index: int, old: dict, new: dict) -> list[str]:
    """The :data:`STEP_KEYS` whose values differ between two copies of param group ``index``'s
    hyper-parameters, as ``"param_groups[i]['lr'] 0.0006 -> 0.0003"`` (Note [late
    hyper-parameters]).

    Raises:
        Nothing.
    """
    return [f"param_groups[{index}][{k!r}] {old.get(k)!r} -> {new.get(k)!r}"
            for k in STEP_KEYS if not _same(old.get(k), new.get(k))]


def _finite(value: Any) -> float | None:
    """``value`` as a float, or None when it is a tensor off the CPU (read it without a
    device synchronisation: not checked)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            return None
        return float(value)
    return float(value)


def check_group(who: str, index: int, group: dict) -> None:
    """Refuse a param group whose ``lr``, ``betas``, ``eps`` or ``weight_decay`` is not a finite
    number in range, or that asks for ``amsgrad`` (Note [finite hyper-parameters]).

    Args:
        who: the error prefix (``"HybridAdam"`` or the rank prefix).
        index: the group's index in ``param_groups``.
        group: the param group (``params`` is not read).

    Raises:
        ValueError: names the group, the field, the value and the fix.
        TypeError: a field is not a number.
    """
    where = f"{who}: param_groups[{index}]"
    if group.get("amsgrad", False):
        raise ValueError(f"{where}['amsgrad']=True is not supported: HybridAdam steps "
                         f"Adam/AdamW without amsgrad; use torch.optim.AdamW(amsgrad=True), or "
                         f"drop amsgrad (a saved amsgrad state cannot be continued exactly)")
    betas = group.get("betas", (0.9, 0.999))
    values = [(name, group.get(name)) for name in _FIELDS]
    if isinstance(betas, (list, tuple)) and len(betas) == 2:
        values += [("betas[0]", betas[0]), ("betas[1]", betas[1])]
    else:
        raise ValueError(f"{where}['betas']={betas!r} must be two numbers, e.g. (0.9, 0.999)")
    for name, value in values:
        if value is None:
            continue
        try:
            number = _finite(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{where}[{name!r}]={value!r} must be a number") from None
        if number is None:
            continue
        high = 1.0 if name.startswith("betas") else math.inf
        if not math.isfinite(number) or number < 0.0 or number >= high:
            bound = "in [0, 1)" if name.startswith("betas") else "finite and >= 0"
            raise ValueError(f"{where}[{name!r}]={value!r} must be {bound}: a non-finite or "
                             f"out-of-range value would turn the parameters into NaN; fix the "
                             f"value (or the LR scheduler that set it) before step()")


def check_groups(who: str, groups: list[dict], max_grad_norm: Any = None) -> None:
    """:func:`check_group` on every group, and ``max_grad_norm`` finite and > 0 (or None).

    Raises:
        ValueError: see :func:`check_group`; ``max_grad_norm`` not finite or not > 0.
        TypeError: a field is not a number.
    """
    for index, group in enumerate(groups):
        check_group(who, index, group)
    if max_grad_norm is not None:
        if not math.isfinite(float(max_grad_norm)) or float(max_grad_norm) <= 0.0:
            raise ValueError(f"{who}: max_grad_norm={max_grad_norm!r} must be a finite number "
                             f"> 0, or None for no clipping")


def check_dense_grad(who: str, g: int, i: int, param: torch.Tensor) -> None:
    """Refuse a sparse (or otherwise non-strided) gradient of param ``i`` of group ``g``.

    Raises:
        TypeError: names the param, the layout and the fix.
    """
    grad = param.grad
    if grad is not None and grad.layout != torch.strided:
        raise TypeError(f"{who}: param {i} of param group {g} (shape {tuple(param.shape)}) got a "
                        f"{grad.layout} gradient; HybridAdam steps dense gradients only (as "
                        f"torch.optim.AdamW): build the module with sparse=False (e.g. "
                        f"nn.Embedding(..., sparse=False)) or optimize those params with "
                        f"torch.optim.SparseAdam")
