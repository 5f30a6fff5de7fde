"""The end of HybridAdam's ``step()``: the GPU side stepped with torch's fused Adam on the
caller's stream (:func:`step_gpu_side`), then the step completed (:func:`finish_step`: wait for
the CPU side, make the caller's stream wait for its H2D copies, count the step, record its
stats), at once or, with ``param_sync="forward"``, in the next forward (Note [forward sync]).
The optimizer is passed in: this module never imports ``hybrid_adam``.

Note [failed steps]: when the CPU side of a step fails (an NVMe read or write of a chunk's
state, out of host memory, a lane kernel), the chunks stepped before the error kept their
update (moments, master, parameter), the failed and later chunks did not, the GPU side was
stepped and no step count moved. No later step can make that exact, so ``finish_step`` raises
the error once and marks the optimizer failed (``opt._failed``, the error): from then on
``step()`` and ``state_dict()`` refuse (:func:`refuse_after_failure`; a checkpoint saved from
the mixed state would resume inexactly) until ``load_state_dict()`` replaces the state, as
``tiermem.checkpoint.load_checkpoint`` does with the model's weights. Nothing is lost by the
failure itself: a key whose NVMe write failed stays in RAM, one whose read failed keeps its
NVMe copy, so a checkpoint taken before the failed step resumes bit for bit. A load rewrites
every byte of each chunk, so a chunk whose NVMe copy cannot be read (a spill file truncated or
changed by someone else) is replaced by a fresh blob rather than failing the load
(``offloaded_pieces(overwrite=True)``, state_dict.py); a load that fails partway leaves the
optimizer failed too.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tiermem.optim.gpu_lane import fused_adam_, fused_adam_moments_
from tiermem.optim.grad_reads import refuse_written_grads
from tiermem.optim.layout import WIDE_BATCH_NUMEL, Group, wide_batches
from tiermem.optim.modes import Mode


_REFUSED = ("step() and state_dict() refuse until the model and the optimizer are restored "
            "from a checkpoint (Note [failed steps])")


def refuse_after_failure(opt: Any, what: str) -> None:
    """Refuse ``what`` (``"step()"``, ``"state_dict()"``) of HybridAdam ``opt`` after a failed
    CPU step (Note [failed steps]).

    Raises:
        RuntimeError: a step failed since the state was last loaded; names the error and the fix.
    """
    failed = getattr(opt, "_failed", None)
    if failed is not None:
        raise RuntimeError(
            f"{opt._who}.{what} refused: an earlier step's CPU side or load_state_dict() "
            f"failed partway ({failed}), so this optimizer's state is no longer one step's "
            f"and continuing cannot be exact (Note [failed steps]); fix: restore the "
            f"model and the optimizer from a checkpoint taken before it "
            f"(tiermem.checkpoint.load_checkpoint, or load_state_dict on both), or make a new "
            f"HybridAdam") from failed


def finish_step(opt: Any) -> None:
    """Wait for the CPU side of HybridAdam ``opt``'s last ``step()``, make the caller's stream
    wait for its H2D copies, count the step and start the next one.

    Raises:
        RuntimeError: the CPU step failed (here or, under torch.distributed, on another rank),
            or a param was changed while the step was still updating it (Note [param changes]).
    """
    opt._pending = False
    t_step = opt._t_step
    t_wait = time.perf_counter()
    step = opt._step
    with step.idle:
        while step.outstanding:
            step.idle.wait()  # the CPU step of every offloaded chunk has to finish
        errors, step.errors = step.errors, []
        events = step.h2d_events
    stall = time.perf_counter() - t_wait
    if opt._mode.other_rank_failed(bool(errors)) and not errors:
        opt._begin_step()  # this step is lost: Note [failed steps]
        opt._failed = RuntimeError("another rank's CPU step failed")
        raise RuntimeError(f"{opt._who}: another rank's CPU step failed (its error names "
                           f"it); this step was abandoned on every rank, {_REFUSED}")
    if errors:
        opt._begin_step()
        opt._failed = errors[0]  # Note [failed steps]
        raise RuntimeError(f"{opt._who}: the CPU step failed: {errors[0]} (some offloaded "
                           f"chunks may have been updated: {_REFUSED})") from errors[0]
    consumer = opt._copier.consumer_stream()
    for event in events if consumer is not None else ():
        consumer.wait_event(event)  # the next forward reads the parameters copied H2D
    opt._mode.gather_params(opt._groups)
    raced = [(g.index, i) for g, i in opt._stepped  # Note [param changes]
             if i in g.plan.chunks_of_param and opt._watch.changed(g.index, i)]
    # Note [gradient writes after a forward-synced step]: compared on the copy stream
    written = step.reads.verdict(opt._copier.d2h_stream if opt._copier.cuda else None)
    for g, i in opt._stepped:
        g.steps[i] += 1  # after the worker: it steps chunks with steps[i] + 1
    moved = opt._store.stats()["moved_bytes"]
    with opt._step.stats_lock:
        done = dict(opt._step.stats, stall_s=stall, step_s=time.perf_counter() - t_step)
        done["nvme_read_bytes"] = moved.get("nvme->cpu", 0) - opt._moved0.get("nvme->cpu", 0)
        done["nvme_write_bytes"] = moved.get("cpu->nvme", 0) - opt._moved0.get("cpu->nvme", 0)
        opt._last_stats = done
    opt._begin_step()
    if raced:  # the step is complete; the changed values are taken at the next one
        raise RuntimeError(
            f"{opt._who}: param {raced[0][1]} of param group {raced[0][0]} was changed while "
            f"the step was still updating it (param_sync='forward'), racing with its copy "
            f"back: call opt.synchronize() before changing parameters after step()")
    refuse_written_grads(opt._who, written)  # the step is complete and counted


def step_gpu_side(g: Group, hp: dict, mode: Mode, moments_dtype: torch.dtype) -> None:
    """Step group ``g``'s GPU side with torch's fused Adam on the caller's stream, with the
    hyper-parameters ``hp`` (its param group) and the gradients ``mode`` gives. fp32 moments
    and fp32 gradients: in place, in one call, no copies. Otherwise in batches of at most
    ``WIDE_BATCH_NUMEL`` elements (:func:`~tiermem.optim.layout.wide_batches`), each through
    :func:`fused_adam_moments_` with its gradients widened to fp32 for the call: bf16 moments
    are widened to fp32, stepped and rounded back (as the lane and the CPU kernel do), fp32
    moments stepped in place; so the transient fp32 copies are at most 12 B (bf16 moments) or
    4 B (fp32 moments, gradients of bf16 params) x ``WIDE_BATCH_NUMEL``, not per GPU-side
    param. The update is elementwise and batches cut pieces at multiples of 16
    (``WIDE_BATCH_NUMEL``'s docstring), so they change no bit.

    Raises:
        Nothing of its own (the gradients were checked by ``step()``).
    """
    idx = [k for k, pc in enumerate(g.plan.gpu_pieces) if mode.has_grad(g, pc.param)]
    for dev in dict.fromkeys(g.gpu_masters[k].device for k in idx):  # streamed: the host
        _step_pieces(g, hp, mode, moments_dtype,
                     [k for k in idx if g.gpu_masters[k].device == dev])


def _step_pieces(g: Group, hp: dict, mode: Mode, moments_dtype: torch.dtype,
                 idx: list[int]) -> None:
    """Step GPU-side pieces ``idx`` of group ``g`` (one device) for :func:`step_gpu_side`."""
    grads = []  # in the model dtype: non-fp32 gradients are widened per batch below
    for k in idx:
        pc = g.plan.gpu_pieces[k]
        grads.append(mode.grad_of(g, pc.param).detach()[pc.start:pc.start + pc.numel])
    masters = [g.gpu_masters[k] for k in idx]
    steps = [g.gpu_steps[k] for k in idx]
    torch._foreach_add_(steps, 1)
    if moments_dtype == torch.float32 and all(gr.dtype == torch.float32 for gr in grads):
        fused_adam_(masters, grads, [g.gpu_exp_avg[k] for k in idx],
                    [g.gpu_exp_avg_sq[k] for k in idx], steps, hp)
    else:  # something to widen: WIDE_BATCH_NUMEL elements at a time
        for batch in wide_batches([m.numel() for m in masters], WIDE_BATCH_NUMEL):
            fused_adam_moments_(
                [masters[j][lo:hi] for j, lo, hi in batch],
                [grads[j][lo:hi].float() for j, lo, hi in batch],
                [g.gpu_exp_avg[idx[j]][lo:hi] for j, lo, hi in batch],
                [g.gpu_exp_avg_sq[idx[j]][lo:hi] for j, lo, hi in batch],
                [steps[j] for j, _, _ in batch], hp)
    for k in idx:
        if g.gpu_views[k] is not g.gpu_masters[k]:
            g.gpu_views[k].copy_(g.gpu_masters[k])
