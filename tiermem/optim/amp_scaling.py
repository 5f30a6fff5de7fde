"""HybridAdam under ``torch.amp.GradScaler``: torch's protocol for optimizers that take the
scale themselves, so that ``scaler.step(opt)`` always reaches ``step()`` (Note [grad scaler]),
and the CPU step during backward under a scaler, speculating that the step is finite (Note
[grad scaler overlap]), also of streamed weights (Note [streamed grad scaler]).

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
whatever it found. :func:`take_scaler` in ``step()``: an inf/NaN step is skipped (nothing is
applied: chunks stepped speculatively are put back, Note [grad scaler overlap]; the step's
counts are reset, as if torch's scaler had not called it); otherwise :func:`settle_step`
unscales the gradients in place by the kernel and the reciprocal GradScaler.unscale_ uses
(computed in fp64, as torch does), so the step is bit-identical to torch's path
(tests/optim/test_grad_scaler.py, tests/optim/test_grad_scaler_overlap.py). A step whose
backward let the CPU side step scaled gradients with no way back (a scaler first seen after
steps without one) is refused (a one-line error naming the fixes; the step is abandoned like a
refused one, chunks not yet stepped are not), and so is torch's own GradScaler over gradients
on another device than its scale (Note [streamed grad scaler]). fp16 gradients are refused as
``GradScaler.unscale_`` refuses them.
GradScaler deletes ``grad_scale`` and ``found_inf`` only when ``step()`` returns, and its next
step multiplies a ``grad_scale`` it finds into its own scale (torch's "product of the scales"
for a caller who set one): a refused step's, left behind, made the next scaler's first step
unscale by the scale squared (the H200 run of tests/stream/test_stream_grad_scaler_cuda.py:
torch's scaler refused, then a StreamedGradScaler's first update 1.2e-4 relative off in the
next loss). So when ``step()`` raises under ``GradScaler.step(opt)`` (any refusal, before the
scaler is taken or after), :func:`drops_scaler_step_on_error` deletes both, as torch deletes
them on return; and a scaler refused for itself (its scale on another device, an fp16
gradient) registers nothing and counts as no step (Note [grad scaler overlap]: the next steps
hold or speculate as before it). So the same optimizer trains on under another scaler as a
fresh one does (bit for bit on the CPU: tests/stream/test_stream_grad_scaler.py). Attributes a
caller set by hand for a plain ``step()`` are kept, and each ``found_inf`` (a new tensor every
step) is taken once, so a later plain ``step()`` ignores one left behind. Cost: what torch's
scaler costs (one read of ``found_inf`` on the host per step, as
``GradScaler._maybe_opt_step`` makes, and one of the scale). A scale driven
by hand (``p.grad.data.mul_(1 / s)`` after backward) moves no version either: Note [gradient
checksums] refuses it, as it refuses ``scaler.unscale_(opt)`` after an overlapped backward
(clip with ``max_grad_norm`` instead: the norm is that of the unscaled gradients).

Note [grad scaler overlap]: how the CPU step keeps overlapping backward under a GradScaler, in
one process (``SCALER_MODES``: ``"local"``, and ``"local+stream"``, whose streamed weights'
chunks follow the same rules: Note [streamed grad scaler]) with ``overlap=True``. The rule for
learning of the scaler:
until the first ``step()``, no chunk is stepped before ``step()`` (they are handed over in
backward and wait, as with ``placement="trace"``, whose first backward hands nothing over);
the first ``scaler.step(opt)`` registers its scaler (found on the call stack: the
``GradScaler.step`` frame that called ``step()``; kept weakly; each scaler step registers its
own), and from then on (also after that scaler is dropped: a resumed run's new one is exact
from its first step) every chunk waits for ``step()``'s verdict -- or, with
``rollback_bytes > 0``, is stepped speculatively,
as Note [speculative step] steps chunks before the clip: it takes a rollback slot (chunks
beyond the budget wait, Note [held chunks]), the worker copies the scaler's current scale with
the chunk's gradients (the D2H that waits for backward reads it: the scale the loss was scaled
with, ``scaler.update()`` having run before this backward) and multiplies the chunk's
gradient copy in place by ``1 / scale`` exactly as ``GradScaler.unscale_`` does (the fp64
reciprocal rounded to fp32; torch's ``_amp_foreach_non_finite_check_and_unscale_``: an fp32
multiply rounded to the gradient's dtype, which the ring has) before the kernel reads it. The
GPU lane's chunks are admitted too, each unscaling its fp32 device copy by a snapshot of the
scale with the same kernel and rounding, their copies kept in the lane's device slots (Note
[lane unscale] in gpu_lane.py, Note [lane rollback on the GPU]). In ``step()``:
- inf/NaN (``found_inf``, the scaler's own check of every gradient): admission closes, every
  admitted chunk is put back (``Speculation.undo``: state from its copy, params from the
  restored masters) and the step is skipped, as torch's scaler skips it;
- finite: admission closes, ``step()`` waits until every admitted chunk has read its
  gradients, compares the scale each one unscaled by with the scale ``step()`` was given
  (``opt.grad_scale``; none on a plain ``opt.step()``), unscales every ``p.grad`` in place as
  before, once Note [gradient checksums] has compared its sums (the GPU side, the norm of ``max_grad_norm`` and every chunk stepped after the
  verdict read the unscaled gradients; on CUDA their copies wait for the unscale's event) and
  lets the speculative steps stand -- unless a scale differed (a scaler not yet known, or one
  changed by hand between backward and ``step()``) or the clip coefficient is not 1: then the
  admitted chunks are rolled back and stepped again from the unscaled (clipped) gradients, as
  Note [speculative step] does. Either way the result is torch's AdamW + GradScaler's bit for
  bit (the unscale is elementwise: the same bits on the host copy as in place). ``step_stats()``
  counts ``speculated_chunks`` and ``rolled_back_chunks`` (a skipped step: all of them).
Cost: with ``rollback_bytes=0`` the CPU step no longer overlaps backward under a scaler (it
waits for the verdict, as with clipping); with it, a pass over each speculated chunk's gradient
copy (the unscale) and what Note [speculative step] costs.

Note [unscaled before the hand-over]: when backward handed nothing to the CPU step (fewer
backward passes than ``grad_accumulation_steps``, an epoch's short last window; gradients set
by hand), :func:`take_scaler` unscales every ``p.grad`` in place at once and ``step()`` then
ships them all. Admission to the speculative step used to be still open there, so the chunks
it shipped were admitted, copied the scaler's scale with their gradients and unscaled their
copies a second time; the scale matched ``step()``'s, so nothing rolled back (CPU, a short
window under ``GradScaler`` with ``rollback_bytes``: 0.011 from the waiting optimizer's
weights after 6 steps). :func:`take_scaler` now closes admission before that unscale: those
chunks wait for the verdict, as with ``rollback_bytes=0``, and read the unscaled gradients
after their own events (recorded when ``step()`` ships them, behind the unscale on the
caller's stream). Nothing overlapped backward on such a step, so no overlap is lost.
tests/optim/test_worker_windows.py.

Note [streamed grad scaler]: streamed weights (Note [streamed write-back] in streamed.py) under
a GradScaler. Their gradients reach HybridAdam as host tensors handed over by the stream in
backward (Note [streamed gradient hand-off] in tiermem/stream/grads.py) and are ``p.grad``
between passes, so the scaler's check and :func:`settle_step`'s unscale see them as any
gradient. Their chunks follow Note [grad scaler overlap] unchanged (``"local+stream"`` is one of
``SCALER_MODES``): the first step's are held for ``step()``; then each waits for the verdict
(``rollback_bytes=0``: the host gradient stays as backward left it until ``step()`` has
unscaled it in place) or is stepped speculatively. Three things differ from device gradients:
- a speculated chunk's streamed pieces are never stepped in place (Note [in-place host chunks]
  in chunk_worker.py: the kernel would read the still-scaled host gradient, and the unscale in
  ``step()`` rewrites it): they are copied host to host into the gradient ring, whose copy the
  worker unscales as any chunk's; the scale is copied with them even when the chunk has no
  device gradient (``d2h_many`` after the gradients' events, or after the caller's stream when
  they have none). A restored chunk is stepped again in place from the unscaled gradient, and a
  skipped step's rollback writes the restored masters into the host copies (Note [streamed
  rollback] in speculate.py);
- the norms taken at the streamed gradients' takes (Note [streamed gradient norms]) are of the
  scaled gradients, and the unscale moves no version: :func:`_unscale` drops them
  (``StreamedMode.forget_norms``) so ``max_grad_norm`` measures the unscaled gradients, and
  once a scaler has been seen none are taken;
- on CUDA the scale is on the GPU and these gradients on the host. Torch's GradScaler checks
  them through ``_MultiDeviceReplicator``, whose host copies of the scale's reciprocal and of
  the inf flag are made with ``non_blocking=True`` (a device-to-host copy that may land after
  the call returns: torch's guide to ``non_blocking``; read in torch 2.13's grad_scaler.py, not
  observed here, no GPU) and read and written at once by the CPU kernel: a stale reciprocal
  multiplies the gradients, a late flag overwrites a found inf (the race pytorch/pytorch#176429
  describes for FSDP's CPU offload). Nothing after the check can repair that, so ``step()``
  refuses a scaler whose scale is on another device than some gradient unless it is a
  :class:`StreamedGradScaler` and those gradients are on the host:
  torch's class whose ``_unscale_grads_`` gives those gradients blocking copies (two scalar
  copies that wait for the caller's stream, at the end of backward, per step; not timed) and
  leaves the rest to torch. :func:`_unscale` copies the
  reciprocal to the host blocking too. On the CPU scale and gradients share the device: torch's
  scaler is exact (tests/stream/test_stream_grad_scaler.py; on CUDA,
  tests/stream/test_stream_grad_scaler_cuda.py).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch

from tiermem._log import logger
from tiermem.optim.step_state import StepState, new_stats

_ANY = object()
"""A speculated chunk that read no gradient through the ring: any scale will do."""

_SCALER_FRAMES = 16
"""How far up the call stack :func:`_calling_scaler` looks for ``GradScaler.step``."""

SCALER_MODES = ("local", "local+stream")
"""The modes whose chunks hold or speculate under a scaler (Note [grad scaler overlap], Note
[streamed grad scaler])."""


class ScalerState:
    """What HybridAdam knows of the GradScaler that drives it (Note [grad scaler overlap]).

    Threads: the caller (``take_scaler``, ``settle_step``, ``holds``), the worker
    (``scale_to_copy``, ``unscale_copies``); ``_used`` is under ``_lock``.

    Attributes:
        supported: the mode can hold and speculate under a scaler (one process, overlap).
        stepped: a ``step()`` has run (until then every chunk waits for ``step()``).
        seen: a GradScaler has driven a step (from then on every chunk waits or speculates).
        pending: the scale of this step's gradients, to unscale in place (None: none).
        expected: its value (None: the gradients are not scaled this step).
    """

    def __init__(self, spec: Any, supported: bool) -> None:
        """Args: the optimizer's Speculation and whether the mode is supported.

        Raises:
            Nothing.
        """
        self._spec = spec
        self.supported = supported
        self.stepped = self.seen = False
        self.pending: torch.Tensor | None = None
        self.expected: float | None = None
        self._scaler: weakref.ref | None = None
        self._used: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def scaler(self) -> Any:
        """The registered GradScaler, or None (none yet, or collected).

        Raises:
            Nothing.
        """
        return self._scaler() if self._scaler is not None else None

    def holds(self) -> bool:
        """Whether chunks wait for ``step()``'s verdict this step (caller's thread, when a step
        begins): before the first ``step()`` and once a scaler has been seen (also when it was
        dropped since: a new one may come, whose steps are exact then).

        Raises:
            Nothing.
        """
        return self.supported and (not self.stepped or self.seen)

    def scale_to_copy(self, item: tuple[int, int]) -> tuple | None:
        """For chunk ``item`` about to have its gradients copied (worker thread): when it was
        admitted to a speculative step and a scaler is registered, ``(a host scalar, the
        scaler's scale)`` to copy with the gradients; else None. Records what it read under.

        Raises:
            Nothing beyond torch's errors.
        """
        if not self._spec.admitted_early(item):
            return None
        scaler = self.scaler()
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        with self._lock:
            self._used[item] = None if scale is None else _ANY
        if scale is None:
            return None
        return torch.empty((), dtype=torch.float32, pin_memory=scale.is_cuda), scale

    def unscale_copies(self, item: tuple[int, int], grads: list[torch.Tensor],
                       scale_host: torch.Tensor) -> None:
        """Unscale chunk ``item``'s gradient copies ``grads`` (the ring's) in place by
        ``scale_host`` (copied, and landed, with them): :func:`unscale_copy_`. Worker thread.

        Raises:
            Nothing beyond torch's errors.
        """
        value = float(scale_host)
        if grads:
            unscale_copy_(grads, value)
        with self._lock:
            self._used[item] = value

    def differs(self, admitted: list[tuple[int, int]]) -> bool:
        """Whether an admitted chunk read its gradients under another scale than
        ``expected`` (caller's thread, every admitted chunk issued).

        Raises:
            Nothing.
        """
        with self._lock:
            used = [self._used.get(item) for item in admitted]
        return any(u is not _ANY and u != self.expected for u in used)

    def forget(self) -> None:
        """Drop the scales recorded (caller's thread, the worker idle: a step begins).

        Raises:
            Nothing.
        """
        with self._lock:
            self._used.clear()


def unscale_copy_(grads: list[torch.Tensor], scale: float) -> None:
    """Multiply host gradient copies ``grads`` (one dtype) in place by ``1 / scale`` exactly as
    ``GradScaler.unscale_`` multiplies ``p.grad``: the fp64 reciprocal rounded to fp32, then
    torch's unscale kernel (fp32 product rounded to the gradient's dtype).

    Raises:
        Nothing beyond torch's errors.
    """
    inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    found = torch.zeros((), dtype=torch.float32)  # step() has the scaler's own verdict
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)


def _calling_scaler(opt: Any = None) -> Any:
    """The ``torch.amp.GradScaler`` whose ``step()`` called this ``step()`` (with ``opt``:
    stepping ``opt``), or None."""
    code = torch.amp.GradScaler.step.__code__
    frame = sys._getframe(1)
    for _ in range(_SCALER_FRAMES):
        if frame is None:
            return None
        if frame.f_code is code:
            scaler = frame.f_locals.get("self")
            if opt is not None and frame.f_locals.get("optimizer") is not opt:
                return None
            return scaler if isinstance(scaler, torch.amp.GradScaler) else None
        frame = frame.f_back
    return None


def drop_scaler_step(opt: torch.optim.Optimizer) -> None:
    """After ``opt.step()`` raised under ``torch.amp.GradScaler.step(opt)``: delete the
    ``opt.grad_scale`` and ``opt.found_inf`` that scaler set, as it deletes them when
    ``step()`` returns; its next step would multiply the ``grad_scale`` it finds into its own
    scale (Note [grad scaler]). Nothing without such a scaler on the call stack (a caller who
    set them by hand keeps them).

    Raises:
        Nothing.
    """
    if _calling_scaler(opt) is None:
        return
    for name in ("grad_scale", "found_inf"):
        if name in vars(opt):
            delattr(opt, name)


def drops_scaler_step_on_error(step: Callable) -> Callable:
    """Decorate an optimizer's ``step`` so that when it raises, :func:`drop_scaler_step` runs
    first (a refused step leaves nothing of its scaler behind: Note [grad scaler]).

    Raises:
        Nothing of its own: the step's error, unchanged.
    """
    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            drop_scaler_step(self)
            raise

    return wrapper


def take_scaler(opt: torch.optim.Optimizer, step: StepState, who: str,
                begin_step: Callable[[], None]) -> bool:
    """In ``step()``: whether a GradScaler found an inf/NaN gradient (skip the step, after
    putting back the chunks stepped speculatively and ``begin_step()``); registers the scaler
    and keeps its scale for :func:`settle_step` (Note [grad scaler], Note [grad scaler
    overlap]). False without a scaler.

    Raises:
        RuntimeError: the CPU side stepped scaled gradients during backward with no way back;
            gradients on another device than the scale, under a scaler that is not a
            :class:`StreamedGradScaler` (Note [streamed grad scaler]).
        ValueError: a gradient to unscale is fp16.
    """
    spec = step.speculation
    amp: ScalerState = spec.amp
    was = (amp.stepped, amp.seen, amp._scaler, spec.enabled, spec.scaler)
    amp.stepped, amp.pending, amp.expected = True, None, None
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is None or found_inf is getattr(opt, "_amp_found_inf_taken", None):
        return False  # no scaler, or one whose step() raised and left its attributes behind
    opt._amp_found_inf_taken = found_inf  # GradScaler makes a new tensor for every step
    with step.lock:
        early = bool(step.shipped)
    if early and (not amp.supported or step.compute_allowed.is_set()):
        step.abandon()  # chunks not yet stepped are not
        begin_step()
        raise RuntimeError(
            f"{who}: torch.amp.GradScaler steps this optimizer, but backward had already "
            f"handed scaled gradients to the CPU step, which stepped them with no way back "
            f"(a scaler first seen after steps without one; Note [grad scaler]); use the "
            f"scaler from the first step(), build HybridAdam with overlap=False, or train "
            f"bf16 without a scaler. This step was not applied consistently: restart from a "
            f"checkpoint")
    scaler = _calling_scaler()
    if amp.supported:  # from the next step on: Note [grad scaler overlap]
        if scaler is None and not amp.seen:  # its scale unknown: speculative steps roll back
            logger.info("%s: no torch.amp.GradScaler.step() on the call stack: chunks stepped "
                        "during backward cannot be unscaled (Note [grad scaler overlap])", who)
        amp.seen = True
        amp._scaler = weakref.ref(scaler) if scaler is not None else None
        spec.enable_scaler()

    def refuse() -> None:
        """A refused scaler (below) is no step and registers nothing: the next steps hold or
        speculate as they would have without it (Note [grad scaler])."""
        amp.stepped, amp.seen, amp._scaler, spec.enabled, spec.scaler = was
        if early:
            step.abandon()  # the held chunks fail: nothing of this step is applied
        begin_step()

    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    far = sorted({str(grad.device) for grad in grads if grad.device != found_inf.device})
    if far and (not isinstance(scaler, StreamedGradScaler) or far != ["cpu"]):
        refuse()
        raise RuntimeError(
            f"{who}: torch.amp.GradScaler's scale is on {found_inf.device} and gradients on "
            f"{', '.join(far)} (streamed weights' host gradients): torch checks them through "
            f"copies of its scale and inf flag made with non_blocking=True, which its kernel "
            f"reads and writes before they land, so its verdict and those gradients may be "
            f"wrong (Note [streamed grad scaler]); use "
            f"tiermem.optim.amp_scaling.StreamedGradScaler (torch's, with blocking copies "
            f"there; host gradients under a GPU scale only) from this step on, or train bf16 "
            f"without a scaler")
    if found_inf.item():  # the host decides, as GradScaler._maybe_opt_step does
        admitted = spec.close(None, wait=False)[0] if spec.active else []
        spec.undone = 0
        if early:
            step.abandon()  # waiting chunks fail, admitted ones are put back
        opt._last_stats = dict(new_stats(), speculated_chunks=len(admitted),
                               rolled_back_chunks=spec.undone, speculating=int(spec.active))
        amp.forget()
        begin_step()  # the next backward starts afresh
        return True
    scale = getattr(opt, "grad_scale", None)
    if scale is not None and any(grad.dtype == torch.float16 for grad in grads):
        refuse()
        raise ValueError(f"{who}: GradScaler: a gradient is fp16, which cannot be unscaled "
                         f"exactly (torch's GradScaler.unscale_ refuses it too); keep the "
                         f"params fp32 under torch.autocast, or train bf16")
    amp.expected = None if scale is None else float(scale)
    if scale is not None and not early:
        if spec.active:  # Note [unscaled before the hand-over]: step() ships them all below
            spec.close(None, wait=False)
        _unscale(grads, scale, opt._mode)  # nothing handed over: no chunk reads them yet
    elif scale is not None:  # the chunks wait (compute_allowed is clear): after the checks
        amp.pending = scale
    return False


def settle_step(opt: Any) -> None:
    """In ``step()``, after its checks and before ``compute_allowed`` is set: close the
    speculative step under a scaler (waiting for the admitted chunks' reads), unscale the
    gradients in place, then clip or keep or roll back the speculative steps (Note
    [speculative step], Note [grad scaler overlap]).

    Raises:
        Nothing of its own.
    """
    spec, step = opt._spec, opt._step
    amp: ScalerState = spec.amp
    consumer = opt._copier.consumer_stream()
    redo = False
    if spec.active and (amp.pending is not None or amp.scaler() is not None):
        admitted, _ = spec.close(consumer, wait=True)
        redo = amp.differs(admitted)
    if amp.pending is not None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        _unscale(grads, amp.pending, opt._mode)
        if opt._copier.cuda:
            event = torch.cuda.Event()
            event.record(consumer)  # the copies of chunks stepped after it read unscaled grads
            step.clip_event = event
    if opt.max_grad_norm is not None or spec.active:
        spec.settle(opt._mode, opt._groups, opt.device, opt.max_grad_norm, opt._copier,
                    opt._worker.enqueue, redo=redo)
    amp.forget()


def _unscale(grads: list[torch.Tensor], scale: torch.Tensor, mode: Any) -> None:
    """Multiply ``grads`` in place by ``1 / scale`` as ``GradScaler.unscale_`` does; the
    streamed gradients' norms taken at their takes (of the scaled gradients; the unscale moves
    no version) are dropped (Note [streamed grad scaler])."""
    forget = getattr(mode, "forget_norms", None)
    if forget is not None:
        forget()
    inv_scale = scale.double().reciprocal().float()  # fp64, as GradScaler.unscale_
    by_key: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_key[(grad.device, grad.dtype)].append(grad)
    for (device, _), group in by_key.items():
        found = torch.zeros((), dtype=torch.float32, device=device)  # checked already
        # a host copy is read at once by the CPU kernel: blocking (Note [streamed grad scaler])
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found, inv_scale.to(device, non_blocking=device.type != "cpu"))


class StreamedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for gradients on another device than its scale: streamed
    weights' host gradients under a CUDA scale (Note [streamed grad scaler]). Those gradients
    are checked and unscaled with blocking host copies of the scale's reciprocal and of the inf
    flag (torch copies them with ``non_blocking=True``, and its CPU kernel reads and writes
    them before the copies land); everything else is torch's. Use it as torch's.

    Raises:
        ValueError: as torch's, an fp16 gradient to unscale.
    """

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """Torch's ``_unscale_grads_`` for the gradients on the scale's device; the others
        per (device, dtype) with blocking copies. Returns the inf flag per device."""
        near, far = [], defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.device == inv_scale.device or grad.is_sparse:
                    near.append(p)
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")  # torch's words
                far[grad.device].append(grad)
        only = types.SimpleNamespace(param_groups=[{"params": near}])  # torch reads only these
        per_device = super()._unscale_grads_(only, inv_scale, found_inf, allow_fp16)
        with torch.no_grad():
            for device, grads in far.items():
                found = found_inf.to(device)  # blocking: the kernel below reads and writes it
                inv = inv_scale.to(device)
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
                for grad in grads:
                    by_dtype[grad.dtype].append(grad)
                for group in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
                per_device[device] = found
        return per_device
