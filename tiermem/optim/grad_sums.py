"""What HybridAdam records of a gradient it takes during backward, so that ``step()`` can tell a
change made to it afterwards, also one no version counter sees (Note [gradient checksums]).

Note [gradient checksums]: with ``overlap=True`` an offloaded gradient is handed to the CPU side
by its post-accumulate-grad hook (copied D2H, maybe stepped, before ``step()``), so a change to
it after backward reaches only the copy left in ``p.grad`` and the step would mix changed and
unchanged gradients (``check_grads_untouched`` in ``step_checks.py`` refuses it). The
gradient's ``_version`` and ``data_ptr`` catch ``clip_grad_norm_``, ``p.grad.mul_(...)`` and a
replaced gradient, but two writes move no version counter: one through ``p.grad.data``
(``p.grad.data.mul_(0.5)``: ``.data`` is a new tensor with a counter of its own) and torch's
``_amp_foreach_non_finite_check_and_unscale_``, the kernel of ``GradScaler.unscale_`` (and of
``GradScaler.step`` when it unscales; Note [grad scaler] in ``amp_scaling.py`` says why
``scaler.step`` leaves the unscale to HybridAdam). So :func:`shipped_mark` also takes, at the
hand-over, the exact checksum of the gradient's bytes (``tiermem.stream.checksums.checksum``:
64-bit integer words summed modulo 2**64, order-free; Note [streamed weight checksums] says
what it cannot catch: a permutation of whole 8-byte words and other rewrites whose words cancel exactly), and
:func:`changed_since_ship` compares it with the bytes in ``step()``. On CUDA the sum is issued
on the current stream right where the hook records the event the D2H copy waits for (the
gradient is complete there), kept as a 0-dim device tensor: no host sync in backward. ``step()``
sums the same gradients again and reads all the pairs at once: one host wait per step for the
GPU to reach ``step()`` (the end of the backward and what follows it), before the GPU side is
stepped; the worker's D2H copies wait for that backward anyway. ``step()`` reads the sums on
its current stream, which orders them after the hook's when backward ran on the caller's
stream (one-stream loops; a backward on a side stream not joined before ``step()`` could be
read early, which can only refuse wrongly, never pass a change). Sums are taken only for
gradients handed over during backward in one process (ZeRO's hooks take the same marks of the
gradients they copy into reduce buckets: Note [reduced gradients untouched] in
dist_modes.py; a gradient handed over in ``step()``
cannot have been changed behind it; ``overlap=False`` and clipping without speculation take
none) and only for device gradients or CPU gradients complete at the hand-over (a streamed
weight's host gradient still landing behind its D2H event is left to the version check).
Cost per step, ``overlap=True``: two reads of the gradients handed over in backward (at the
hand-over, on the backward's stream, and in ``step()``): ~0.7 ms each for 1.3B bf16 gradients
at ~4 TB/s, a sum kernel per gradient at each, and the one host wait above (on the CPU the
sums are taken synchronously: in the hook, a read of the gradient). The refusal keeps
the message of ``check_grads_untouched``, which names the fixes. A change after ``step()``,
while a ``param_sync="forward"`` step still reads the gradients, is watched by sums of the
pieces read instead: Note [gradient writes after a forward-synced step] in grad_reads.py.
"""

from __future__ import annotations

from typing import Any

import torch

from tiermem.optim.step_state import StepState
from tiermem.stream.checksums import checksum

Mark = tuple  # (grad._version, grad.data_ptr(), checksum as a 0-dim int64 tensor or None)


def shipped_mark(grad: torch.Tensor, ready: Any, step: StepState) -> Mark:
    """What ``_ship`` records (under ``step.lock``) of a gradient it hands over: its
    ``_version``, ``data_ptr`` and, when handed over during backward (before ``step()`` froze
    the hyper-parameters) and readable now (a device gradient, or a CPU one without a
    ``ready`` event still to land), its checksum, issued on the current stream
    (Note [gradient checksums]).

    Raises:
        Nothing beyond torch's errors.
    """
    readable = grad.is_cuda or ready is None
    total = checksum(grad.detach()) if step.frozen_hp is None and readable else None
    return (grad._version, grad.data_ptr(), total)


def changed_since_ship(marks: dict[Any, Mark], grads: dict[Any, torch.Tensor]) -> list[Any]:
    """The keys of ``marks`` with a checksum whose gradient in ``grads`` (the same tensor, its
    version and pointer already checked) now sums to something else; one host read per
    device (Note [gradient checksums]).

    Raises:
        Nothing beyond torch's errors.
    """
    by_device: dict[torch.device, tuple[list, list, list]] = {}
    for key, (_, _, total) in marks.items():
        if total is not None:
            keys, then, now = by_device.setdefault(total.device, ([], [], []))
            keys.append(key)
            then.append(total)
            now.append(checksum(grads[key].detach()))
    changed = []
    for keys, then, now in by_device.values():
        differ = (torch.stack(then) != torch.stack(now)).tolist()  # the host reads them next
        changed += [k for k, d in zip(keys, differ) if d]
    return changed
