"""Whether a checkpoint fits the model and optimizer it is loaded into, checked before either
is touched (Note [checkpoint fit]; :func:`tiermem.checkpoint.load_checkpoint` calls these).
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem._ckpt_errors import CheckpointMismatch

# Note [checkpoint fit]
# torch's ``Module.load_state_dict`` copies every tensor that fits before it raises about the
# ones that do not (another shape; with ``strict``, unexpected or missing keys), and
# load_checkpoint loads the model before the optimizer, whose refusal (other param groups)
# then came with the model already overwritten: a failed load left the model half loaded, or
# loaded and the optimizer not. torch's ``Optimizer.load_state_dict`` takes state tensors of
# any shape, so another model's state replaced the optimizer's and the next step failed (or
# broadcast). So before either is touched, :func:`load_checkpoint` compares
# - the model's ``state_dict()`` (what it would save: a streamed model's hooks give its host
#   copies, of the real shapes) with the checkpoint's: keys (``strict``) and the shape of every
#   tensor both have, by torch's rule (a 0-dim tensor takes a saved ``(1,)``; lazy ones pass);
# - the optimizer's number of param groups and of params in each, when its ``load_state_dict``
#   is torch's (which refuses the same after the model was loaded) or tiermem's;
# - for torch.optim's and tiermem's optimizers, each per-param state tensor that they keep in
#   the param's shape (:data:`_PARAM_SHAPED`) against its param; an empty param (a streamed
#   weight's placeholder during a pass) is not compared. Other optimizers may keep such names
#   in other shapes (a low-rank projection's ``exp_avg``);
# - for torch.optim.Adam / AdamW, a HybridAdam group's weight decay style against the one the
#   optimizer would step with (Note [saved weight decay style] in tiermem/optim/state_dict.py).
# A mismatch raises :class:`CheckpointMismatch`, one line naming the file, the first keys and
# both shapes. An optimizer with a ``check_state_dict`` (HybridAdam) then runs its own refusals
# (an amsgrad state, non-finite hyper-parameters; no room for its state on first use,
# ``TierFullError``) on the checkpoint, still before the model is loaded.

_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "master",
                           "momentum_buffer", "square_avg", "acc_delta", "grad_avg", "sum",
                           "ax", "prev", "step_size", "variance"})
"""Per-param state of torch.optim's optimizers (and HybridAdam's ``master``) that has the
param's shape where present (Note [checkpoint fit])."""
_NOTHING_LOADED = "nothing was loaded (the model and optimizer are as they were)"


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _first(keys: list[str], n: int = 3) -> str:
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(repr(k) for k in keys[:n]) + more


def check_model_fits(path: str, model: torch.nn.Module, saved: Any, strict: bool) -> None:
    """Note [checkpoint fit], the model's part.

    Raises:
        CheckpointMismatch: names the first mismatched keys and shapes.
    """
    if not isinstance(saved, dict):
        return  # malformed: the model's own load says so
    own = model.state_dict()
    sized = []
    for key, value in own.items():
        got = saved.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(got, torch.Tensor)) or \
                torch.nn.parameter.is_lazy(value):
            continue
        if value.dim() == 0 and _shape(got) == (1,):
            continue
        if got.shape != value.shape:
            sized.append(f"{key!r} has shape {_shape(got)} in the checkpoint but "
                         f"{_shape(value)} in the model")
    problems = [f"size mismatch: {'; '.join(sized[:3])}" + (
        f" and {len(sized) - 3} more" if len(sized) > 3 else "")] if sized else []
    missing = [k for k in own if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in own] if strict else []
    problems += [f"{what} keys: {_first(keys)}" for what, keys in
                 (("unexpected", unexpected), ("missing", missing)) if keys]
    if problems:
        fix = "load it into the model it was saved from" + (
            "" if sized else ", or pass strict=False to load only the keys both have")
        raise CheckpointMismatch(f"load_checkpoint: checkpoint {path} does not fit the model "
                                 f"({'; '.join(problems)}); {_NOTHING_LOADED}; fix: {fix}",
                                 path)


def check_optimizer_fits(path: str, optimizer: Any, saved: Any) -> None:
    """Note [checkpoint fit], the optimizer's part.

    Raises:
        CheckpointMismatch: names the group, the param and the shapes.
    """
    own = getattr(optimizer, "param_groups", None)
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    states = saved.get("state") if isinstance(saved, dict) else None
    cls = type(optimizer)
    ours = cls.__module__.startswith("tiermem.")
    if not (isinstance(own, list) and isinstance(groups, list) and isinstance(states, dict)) or \
            not (ours or getattr(cls, "load_state_dict", None) is
                 torch.optim.Optimizer.load_state_dict):
        return  # another optimizer's own load decides

    def refuse(problem: str) -> None:
        raise CheckpointMismatch(
            f"load_checkpoint: checkpoint {path} does not fit the optimizer ({problem}); "
            f"{_NOTHING_LOADED}; fix: load it into an optimizer over the same params, in the "
            f"same param groups and order", path)

    if len(groups) != len(own):
        refuse(f"{len(groups)} param groups in the checkpoint but {len(own)} in the optimizer")
    for gi, (group, mine) in enumerate(zip(groups, own)):
        ids, params = group.get("params", ()), list(mine["params"])
        if len(ids) != len(params):
            refuse(f"param group {gi} has {len(ids)} params in the checkpoint but "
                   f"{len(params)} in the optimizer")
        _check_decay_style(path, optimizer, gi, group)
        if not (ours or cls.__module__.startswith("torch.optim")):
            continue
        for sid, p in zip(ids, params):
            state = states.get(sid)
            if not isinstance(state, dict) or p.numel() == 0:
                continue
            for name in sorted(_PARAM_SHAPED & state.keys()):
                t = state[name]
                if isinstance(t, torch.Tensor) and t.shape != p.shape:
                    refuse(f"{name} of param {sid} (group {gi}) has shape {_shape(t)} but the "
                           f"param has {_shape(p)}; the state is for another model")


def _check_decay_style(path: str, optimizer: Any, gi: int, group: dict) -> None:
    """Note [saved weight decay style] in tiermem/optim/state_dict.py: a HybridAdam group
    (``adamw``, no ``decoupled_weight_decay``) with weight decay, loaded into torch.optim.Adam
    (L2 when the group does not say) or AdamW (always decoupled) of the other style.

    Raises:
        CheckpointMismatch: names the group, both styles and the class to load it into.
    """
    if not isinstance(optimizer, torch.optim.Adam) or "adamw" not in group or \
            "decoupled_weight_decay" in group or not group.get("weight_decay"):
        return
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    if bool(group["adamw"]) == decoupled:
        return
    want = "torch.optim.AdamW" if group["adamw"] else "torch.optim.Adam"
    raise CheckpointMismatch(
        f"load_checkpoint: checkpoint {path} does not fit the optimizer (param group {gi} was "
        f"saved by HybridAdam with adamw={bool(group['adamw'])}, weight_decay="
        f"{group['weight_decay']}, but {type(optimizer).__name__} would decay the weights "
        f"{'decoupled' if decoupled else 'as an L2 penalty'}); {_NOTHING_LOADED}; fix: load "
        f"it into {want}", path)


def check_optimizer_accepts(path: str, optimizer: Any, saved: Any) -> None:
    """Note [checkpoint fit]: an optimizer with a ``check_state_dict`` (HybridAdam) refuses
    what its ``load_state_dict`` would, before the model is loaded.

    Raises:
        CheckpointMismatch: its check refused the state (the message names it).
        TierFullError: no room for the optimizer's state (nothing loaded).
    """
    check = getattr(optimizer, "check_state_dict", None)
    if not callable(check):
        return
    try:
        check(saved)
    except ValueError as exc:
        raise CheckpointMismatch(f"load_checkpoint: checkpoint {path} does not fit the "
                                 f"optimizer ({exc}); {_NOTHING_LOADED}", path) from exc
