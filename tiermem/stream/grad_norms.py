"""The 2-norms of streamed weights' gradients, taken where each whole gradient is (on the
device, beside its D2H copy), and the global norm HybridAdam clips by, combined from them as
``torch.nn.utils.get_total_norm`` combines per-tensor norms (Note [streamed gradient norms]).

Note [streamed gradient norms]: with ``max_grad_norm`` HybridAdam's ``step()`` needs the global
2-norm of every gradient. A streamed weight's gradient is a host tensor by then (Note [host
gradients] in tiermem/stream/grads.py), and torch's norm over 2.3 GB of bf16 host gradients
took ~0.5 s of the H200 bench's step (docs/results/bench_stream_clip_s14.log). So
``HostGrads.take`` measures a gradient where it is whole: when the gradient it takes from the
device is the weight's complete gradient of the step (its host gradient was None, and the take
covers at least ``grad_accumulation_steps`` backward passes: a step of one backward pass, or a
block-major pass's device-accumulated gradient), it takes ``torch._foreach_norm([grad], 2.0)``
on the device right after issuing the D2H copy (on the caller's stream, beside the copy), the
call ``get_total_norm`` makes per (device, dtype) group: a tensor's norm from that kernel does
not depend on the other tensors of the list (CUDA: each tensor's chunks are reduced on their
own, padded with zeros; CPU: one ``linalg.vector_norm`` per tensor), so it is the resident
loop's per-tensor norm, bit for bit. It stays a 0-d device tensor (no host synchronisation),
recorded under the host gradient it describes with that tensor's ``_version`` after the copy
was issued. :func:`total_norm` (``StreamedMode.grads_and_norm``) then does what
``_get_total_norm`` does, with a recorded norm standing for its gradient in the group of the
norm's device: the same grouping call (``_group_tensors_by_device_and_dtype``, whose group
order is its own), the same foreach norms for every gradient without a usable record, the
norms stacked in group order on the first gradient's (or its norm's) device, one
``vector_norm``. On the CPU every key is the gradient's own: the global norm is today's and the
unstreamed loop's, bit for bit; on CUDA the streamed weights' norms come from the device, as in
the resident loop, where they used to come from the host (other bits).

A record is used only for the tensor it was taken of, unchanged: the gradient in ``p.grad`` at
``step()`` must be that tensor (a weak reference: a new tensor never matches) at the recorded
``_version`` (a later micro-batch's add, ``zero_grad(set_to_none=False)``, a user's in-place
``mul_`` move it); anything else is measured in ``step()`` as before. Records live for one
step: ``StreamedMode.begin_step`` (after every step, refused ones too) clears them, so a norm
never outlives its step even where no version counter moves (a ``.data`` write or a
GradScaler's unscale kernel, which move none, between two steps on the same gradients). Within
a step such an untracked write after backward is not seen: records are taken only with
``overlap=True``, under which HybridAdam already takes gradients as final when backward ends
(``check_grads_untouched`` refuses a changed one: through the same version counters); with
``overlap=False``, where gradients may be changed before ``step()``, none are taken.

A gradient accumulated over depth-first micro-batches is measured where its last micro-batch
is summed on the device (Note [last pass sums on the device] in tiermem/stream/grads.py: the
host gradient is uploaded, the last gradient added there, the sum copied back and measured
beside that copy, with ``passes`` the sum's). Only where no optimizer that counts the passes is
connected (the adder thread then adds the last micro-batch on the host too, and ``step()``
runs after the pass end's flush, which waits for every add: a norm is never taken of a
half-added gradient; a later take also forgets its gradient's record before its add is
enqueued) or several block-major passes accumulate on the host is a norm measured in
``step()``. ``step_stats`` counts both: ``norms_precomputed`` and ``norms_computed`` (streamed
gradients measured in ``step()``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support
from torch.utils.weak import WeakIdKeyDictionary


def tensor_norm(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s 2-norm as ``torch.nn.utils.get_total_norm`` takes it (a 0-d tensor on its
    device, of its dtype; no host synchronisation).

    Raises:
        Nothing beyond torch's errors.
    """
    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], 2.0)[0]
    return torch.linalg.vector_norm(grad, 2.0)


class GradNorms:
    """Norms of host gradients taken on the device (Note [streamed gradient norms]).

    Attributes:
        want: ``want(passes)``: whether a take covering ``passes`` backward passes into an empty
            host gradient completes it for the step (set by the connected HybridAdam's link);
            None: no norm is taken.
    """

    def __init__(self) -> None:
        """Raises: Nothing."""
        self._norms: WeakIdKeyDictionary = WeakIdKeyDictionary()  # host grad -> (version, norm)
        self.want: Callable[[int], bool] | None = None

    def __len__(self) -> int:
        """Norms held (of gradients still alive).

        Raises:
            Nothing.
        """
        return len(self._norms)

    def measure(self, grad: torch.Tensor, passes: int) -> torch.Tensor | None:
        """The norm of the device gradient ``grad`` (``passes`` backward passes) when it is
        wanted, else None.

        Raises:
            Nothing beyond torch's errors and ``want``'s.
        """
        want = self.want
        if want is None or not want(passes):
            return None
        with torch.no_grad():
            return tensor_norm(grad.detach())

    def record(self, host_grad: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Keep ``norm`` (None: forget) as the norm of ``host_grad`` as it is now.

        Raises:
            Nothing.
        """
        if norm is None:
            self._norms.pop(host_grad, None)
        else:
            self._norms[host_grad] = (host_grad._version, norm)

    def forget(self, host_grad: torch.Tensor) -> None:
        """``host_grad`` is about to change (a later pass's add): drop its norm.

        Raises:
            Nothing.
        """
        self._norms.pop(host_grad, None)

    def lookup(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The recorded norm of ``grad`` if it was taken of this tensor and the tensor has not
        changed since (its ``_version``), else None.

        Raises:
            Nothing.
        """
        item = self._norms.get(grad)
        if item is None or item[0] != grad._version:
            return None
        return item[1]

    def clear(self) -> None:
        """Forget every norm (the step is over).

        Raises:
            Nothing.
        """
        self._norms.clear()


def total_norm(grads: list[torch.Tensor], norms: list[torch.Tensor | None]) -> torch.Tensor:
    """The global 2-norm of ``grads`` as ``torch.nn.utils.get_total_norm(grads, 2.0)``
    computes it, with ``norms[k]`` (not None) standing for the norm of ``grads[k]`` in the group
    of its own device (Note [streamed gradient norms]).

    Raises:
        ValueError: ``norms`` is not one entry per gradient.
    """
    if len(norms) != len(grads):
        raise ValueError(f"total_norm: {len(norms)} norms for {len(grads)} gradients; pass "
                         f"one (or None) per gradient")
    if not grads:
        return torch.tensor(0.0)
    stand: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    keys = []
    for g, n in zip(grads, norms):
        if n is None or n.device == g.device:
            keys.append(g)
            continue
        key = (n.device, g.dtype)
        if key not in stand:  # an empty tensor: groups the norm with its device's gradients
            stand[key] = torch.empty(0, dtype=g.dtype, device=n.device)
        keys.append(stand[key])
    out: list[torch.Tensor] = []
    groups = _group_tensors_by_device_and_dtype([keys], with_indices=True)
    for (device, _), (_, idx) in groups.items():
        members = [grads[k] for k in idx]
        missing = [k for k in idx if norms[k] is None]
        if _has_foreach_support(members, device):
            got = torch._foreach_norm([grads[k] for k in missing], 2.0) if missing else []
        else:
            got = [torch.linalg.vector_norm(grads[k], 2.0) for k in missing]
        computed = dict(zip(missing, got))
        out.extend(computed[k] if norms[k] is None else norms[k] for k in idx)
    first = keys[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in out]), 2.0)
