"""HybridAdam under ``torch.amp.GradScaler``: torch's protocol for optimizers that take the
scale themselves, so that ``scaler.step(opt)`` always reaches ``step()`` (Note [grad scaler]).

Note [grad scaler]: ``scaler.step(opt)`` unscales every ``p.grad`` in place and calls
``opt.step()`` only when none is inf/NaN. Both went wrong with HybridAdam:
- with ``overlap=True`` backward hands the offloaded gradients to the CPU step before
  ``step()`` (Note [hybrid step]): the CPU side stepped the *scaled* gradients (its moments mix
  the scales: a 10-step fp16 loop ended 0.04 away from AdamW + GradScaler), or an overflowed
  step's inf, leaving NaN weights while the scaler skipped ``step()`` (every later step then
  skipped too); the unscale kernel moves no version counter, so nothing was refused;
- where gradients are handed over in ``step()`` (``overlap=False``, or ``max_grad_norm`` in one
  process without speculation), a skipped ``step()`` left the backward counted, so the next
  ``step()`` refused "2 backward passes ... grad_accumulation_steps=1".
HybridAdam (one process) sets ``_step_supports_amp_scaling``: ``scaler.step(opt)`` then checks
the gradients for inf/NaN without unscaling them, sets ``opt.grad_scale`` (the scale; None when
the caller already ran ``scaler.unscale_(opt)``) and ``opt.found_inf``, and calls ``step()``
whatever it found. :func:`take_scaler` in ``step()``: when backward has handed any gradient
over this step, the step is refused (the CPU side has the scaled values; a one-line error
naming the fixes; the step is abandoned like a refused one, chunks not yet stepped are not);
else an inf/NaN step is skipped (nothing was stepped: the step's counts are reset, as if
torch's scaler had not called it), and otherwise the gradients are unscaled in place by the
kernel and the reciprocal GradScaler.unscale_ uses (computed in fp64, as torch does), so the
step is bit-identical to torch's path (tests/optim/test_grad_scaler.py). fp16 gradients are
refused as ``GradScaler.unscale_`` refuses them. GradScaler deletes ``grad_scale`` and
``found_inf`` only when ``step()`` returns, so a refused step leaves them behind: each
``found_inf`` (a new tensor every step) is taken once, and a later plain ``step()`` ignores
it. Cost: what torch's scaler costs (one read of
``found_inf`` on the host per step, as ``GradScaler._maybe_opt_step`` makes). A scale driven
by hand (``p.grad.data.mul_(1 / s)`` after backward) moves no version either: Note [gradient
checksums] refuses it. Left: stepping scaled chunks during backward exactly (the inverse scale
inside the CPU kernel and a rollback of every chunk on inf, as Note [speculative step] rolls
back a clipped step).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from tiermem.optim.step_state import StepState


def take_scaler(opt: torch.optim.Optimizer, step: StepState, who: str,
                begin_step: Callable[[], None]) -> bool:
    """In ``step()``: whether a GradScaler found an inf/NaN gradient (skip the step, after
    ``begin_step()``); unscales the gradients in place when it passed the scale
    (Note [grad scaler]). False without a scaler.

    Raises:
        RuntimeError: gradients were handed to the CPU step during backward (``overlap=True``).
        ValueError: a gradient to unscale is fp16.
    """
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is None or found_inf is getattr(opt, "_amp_found_inf_taken", None):
        return False  # no scaler, or one whose step() raised and left its attributes behind
    opt._amp_found_inf_taken = found_inf  # GradScaler makes a new tensor for every step
    with step.lock:
        early = bool(step.shipped)
    if early:
        step.abandon()  # chunks not yet stepped are not
        begin_step()
        raise RuntimeError(
            f"{who}: torch.amp.GradScaler steps this optimizer, but backward had already "
            f"handed scaled gradients to the CPU step (overlap=True), which cannot unscale "
            f"them or skip an inf/NaN step (Note [grad scaler]); build HybridAdam with "
            f"overlap=False (a GradScaler then works as with torch's optimizers), or "
            f"HybridAdam(max_grad_norm=...) with rollback_bytes=0, or train bf16 without a "
            f"scaler. This step was not applied consistently: restart from a checkpoint")
    if found_inf.item():  # the host decides, as GradScaler._maybe_opt_step does
        begin_step()  # nothing was handed over or stepped: the next backward starts afresh
        return True
    scale = getattr(opt, "grad_scale", None)
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if scale is not None and any(grad.dtype == torch.float16 for grad in grads):
        begin_step()  # nothing was handed over or stepped
        raise ValueError(f"{who}: GradScaler: a gradient is fp16, which cannot be unscaled "
                         f"exactly (torch's GradScaler.unscale_ refuses it too); keep the "
                         f"params fp32 under torch.autocast, or train bf16")
    if scale is not None:
        _unscale(grads, scale)
    return False


def _unscale(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``1 / scale`` as ``GradScaler.unscale_`` does."""
    inv_scale = scale.double().reciprocal().float()  # fp64, as GradScaler.unscale_
    by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_key[(grad.device, grad.dtype)].append(grad)
    for (device, _), group in by_key.items():
        found = torch.zeros((), dtype=torch.float32, device=device)  # checked already
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found, inv_scale.to(device, non_blocking=True))
