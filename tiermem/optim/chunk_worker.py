"""HybridAdam's chunk worker: the thread that steps each offloaded chunk once all its gradients
are complete (Note [hybrid step] in hybrid_adam.py). Per chunk it copies the gradients D2H into
the group's pinned gradient ring (the next chunk's copy runs while this one steps), runs the
native CPU Adam into the pinned param-out ring, copies the params H2D, and writes NVMe chunks
back; chunks of the GPU lane are handed to it instead. A streamed weight's gradient is already
on the host, perhaps still being written by the stream's D2H copy: the worker waits for that
copy's event first (:func:`host_grads_landed`, Note [streamed gradient hand-off]).

Note [in-place host chunks]: a piece of a streamed weight (its gradient and its host copy are
host tensors: Note [streamed write-back] in streamed.py) is stepped in place: the CPU kernel
reads the host gradient itself and writes the updated weights straight into the host copy,
instead of a memcpy of the gradient into the gradient ring and one from the param-out ring
into the host copy (2 + 2 bytes per bf16 weight and step on this thread: with 2^24-element
chunks 64 MiB per chunk, ~2.7 ms of the H200 host's 7.8 ms per streamed chunk in session 14,
when only single-piece chunks were stepped in place and nearly every chunk of the reference
GPT spans two weights). With the native kernel every such piece of any chunk is (the other
pieces of a mixed chunk keep the rings): exact, because the native kernel's result per
element depends on neither the thread count nor how the range is split into calls
(native/adam.c), so one call per piece gives the bits of one call per run. Without it (torch's
fallback kernel rounds its scalar remainder unlike its vector body, so a split changes bits)
only a chunk that is all one piece is: the same kernel call (the same offset and numel) on the
same bytes at other addresses. Safe: after its hand-off a host gradient is
written only by the clip and a GradScaler's unscale, which ``step()`` applies before the
worker may read it (a chunk stepped speculatively before the clip is stepped again unless the
clip multiplied by exactly 1: Note [speculative step]; one speculated under a scaler reads no
piece in place: Note [streamed grad scaler] in amp_scaling.py), or after the step is complete
(the next pass: ``Link.before_pass`` synchronizes; ``zero_grad(set_to_none=False)`` too; a
``model.zero_grad(set_to_none=False)`` before that, with ``param_sync="forward"``, is refused
if it came first: Note [gradient writes after a forward-synced step] in grad_reads.py); the
host copy is written when the ring's memcpy would have written it, and no fill of that pass reads it. The kernel's write bumps no
version: none is needed (HybridAdam marks every weight it stepped changed before the next
pass, and the watch of Note [param changes] only excuses HybridAdam's own bumps).
``step_stats()["in_place_bytes"]`` counts the gradient bytes read in place,
``ring_copy_bytes`` the ones the worker copied host to host into the ring.

Note [worker phases]: where the worker's seconds go, per step, in ``step_stats()``
(``new_stats`` in step_state.py): ``cpu_adam_s`` the kernel (with the native kernel the sums
of the pieces it writes in place included: Note [streamed write-back checksums]);
``copy_wait_s`` the waits for
gradient D2H copies (a streamed gradient's D2H event included) and param-out ring slots;
``grad_copy_s`` putting gradients into the ring (issuing D2H copies; host-to-host memcpys of
streamed gradients); ``state_s`` getting a chunk's state blob from the store (an NVMe read
not yet read ahead), the speculation's copy or restore and the read-ahead; ``write_back_s``
issuing the param-out copies (H2D; host-to-host memcpys into a streamed weight's host copy),
the sums of the other written pieces of host copies (``piece_checksum``, a re-read) and an
NVMe chunk's write-back; what ``worker_s`` has beyond them is Python bookkeeping.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any

import torch

from tiermem.optim.cpu_adam import adam_step_unchecked, native_available
from tiermem.optim.gpu_lane import GpuLane
from tiermem.optim.layout import (GRAD_SLOTS, OUT_SLOTS, Group, StateLayout, local_view, runs,
                                  state_views)
from tiermem.optim.partition import Chunk, Piece
from tiermem.optim.read_ahead import ReadAhead
from tiermem.optim.step_state import StepState
from tiermem.store.transfer import Copier

_STOP = object()
"""Tells the worker thread to exit."""


def host_grads_landed(refs: dict[int, tuple | None], block: bool = True) -> bool:
    """Wait until every host gradient in ``refs`` (local tensor -> ``(flat gradient, event)``
    or None) may be read: a streamed weight's gradient is handed over with the event of the
    D2H copy still writing it (Note [streamed gradient hand-off] in tiermem/stream/grads.py).
    With ``block`` False, return False instead of waiting while one has not landed. A device
    gradient's event is the D2H copy's to wait for, not the host's.

    Raises:
        RuntimeError: CUDA's errors.
    """
    events = [ref[1] for ref in refs.values()
              if ref is not None and ref[1] is not None and ref[0].device.type == "cpu"]
    if not block and not all(ev.query() for ev in events):
        return False
    for ev in events:
        ev.synchronize()  # the worker reads the host gradient this D2H copy writes
    return True


def in_place_grads(group: Group, chunk: Chunk, refs: dict[int, tuple | None],
                   split_ok: bool, scaled: bool = False) -> dict[int, torch.Tensor]:
    """The pieces of chunk ``chunk`` the worker steps in place (Note [in-place host chunks]):
    local tensor -> its flat host gradient, for each piece of a streamed weight
    (``group.host_copies``) whose gradient this step (``refs``: local tensor -> ``(flat
    gradient, event)`` or None) is a host tensor of the gradient ring's dtype; with
    ``split_ok`` False (not the native kernel) only a chunk that is all one such piece; none
    when ``scaled`` (the gradients are still scaled: the ring's copy is unscaled instead,
    Note [streamed grad scaler] in amp_scaling.py).

    Raises:
        Nothing.
    """
    if scaled or (not split_ok and len(chunk.pieces) != 1):
        return {}
    dtype = group.grad_ring[0].dtype
    return {pc.param: refs[pc.param][0] for pc in chunk.pieces
            if pc.param in group.host_copies and refs[pc.param] is not None
            and refs[pc.param][0].device.type == "cpu" and refs[pc.param][0].dtype == dtype}


def kernel_calls(group: Group, chunk: Chunk, has_grad: dict[int, bool],
                 direct: dict[int, torch.Tensor]) -> list[tuple[int, int, int, Piece | None]]:
    """The CPU kernel's calls for chunk ``chunk``, in chunk order: ``(start in the chunk,
    elements, step, piece)``; ``piece`` is a piece stepped in place (a key of ``direct``:
    Note [in-place host chunks]), one call each, or None for a run of the gradient ring's
    elements (``runs``: consecutive pieces with gradients and one step count; exactly
    ``runs`` when nothing is in place).

    Raises:
        Nothing.
    """
    ring = {p: has and p not in direct for p, has in has_grad.items()}
    calls = [(start, numel, step, None) for start, numel, step in runs(group, chunk, ring)]
    calls += [(pc.flat_offset - chunk.flat_start, pc.numel, group.steps[pc.param] + 1, pc)
              for pc in chunk.pieces if pc.param in direct]
    return sorted(calls, key=lambda call: call[0])


def stop_thread(work: queue.Queue, thread: threading.Thread) -> None:
    """Stop a :class:`ChunkWorker`'s thread (its ``queue`` and ``thread``) once it has finished
    the chunk in hand; holds no reference to the worker (Note [lifetime] in lifetime.py).

    Raises:
        Nothing.
    """
    work.put(_STOP)
    if thread is not threading.current_thread():  # a collection on the worker thread may call us
        thread.join()


class ChunkWorker:
    """The worker thread and what only it touches: the chunks' gradient copies, the CPU step,
    the param-out ring and the write-back of NVMe chunks.

    Attributes:
        queue: chunks ``(group, chunk)`` ready to step, in the order they became ready.
        thread: the worker thread (named ``tiermem-hybrid-adam``, a daemon).
    """

    def __init__(self, layout: StateLayout, step: StepState, read_ahead: ReadAhead,
                 lane: GpuLane, copier: Copier, param_groups: list[dict],
                 cpu_threads: int | None) -> None:
        """Start the thread. Args: the optimizer's layout, step state, read-ahead and GPU lane,
        the Copier of the gradients' D2H and the params' H2D, its ``param_groups`` (the live
        hyper-parameters) and the CPU step's threads (None: torch's).

        Raises:
            RuntimeError: the thread could not be started.
        """
        self._layout = layout
        self._step = step
        self._read_ahead = read_ahead
        self._lane = lane
        self._copier = copier
        self._param_groups = param_groups
        self._cpu_threads = cpu_threads
        self._copies: dict[tuple[int, int], tuple] = {}  # chunks whose D2H is issued
        self.queue: queue.Queue = queue.Queue()
        # Note [lifetime] (lifetime.py): the thread refers to this worker weakly, never to the
        # optimizer
        self.thread = threading.Thread(target=self._run, args=(weakref.ref(self), self.queue),
                                       name="tiermem-hybrid-adam", daemon=True)
        self.thread.start()

    def enqueue(self, item: tuple[int, int]) -> None:
        """Hand chunk ``item`` to the worker, once per step (hooks or the caller's thread).

        Raises:
            Nothing.
        """
        step = self._step
        with step.lock:
            if item in step.queued:
                return
            if step.speculation is not None and not step.speculation.claim(item):
                return  # Note [held chunks] (speculate.py): step() queues it with the norm
            step.queued.add(item)
            step.outstanding += 1
        self.queue.put(item)

    def begin_step(self) -> None:
        """Forget the last step's gradient copies (caller's thread; the worker is idle between
        steps).

        Raises:
            Nothing.
        """
        self._copies.clear()

    @staticmethod
    def _run(ref: weakref.ref, work: queue.Queue) -> None:
        """The worker thread (Note [lifetime] in lifetime.py): holds the worker only while it handles an item,
        and waits for the next one through a weak reference, so a dropped optimizer is
        collected and its finalizer's ``_STOP`` ends this thread."""
        nxt = None
        while True:
            worker = ref()
            if worker is None:
                return
            if nxt is None and worker._lane.pending and work.empty():
                worker._lane.reap(block=True)  # nothing else to do: wait for a lane write-back
                continue  # and look at the queue again
            del worker
            item = nxt if nxt is not None else work.get()
            worker = ref()
            if item is _STOP or worker is None:
                while worker is not None and worker._lane.pending:
                    worker._lane.reap(block=True)
                return
            nxt = worker._work_item(item)
            del worker

    def _work_item(self, item: tuple[int, int]) -> Any:
        """Step one chunk (worker thread); return the next queue item if it took one early."""
        nxt = None
        t0 = time.perf_counter()
        lane = item in self._lane.chunks  # done when its write-back is (see GpuLane.reap)
        try:
            if lane:
                while self._step.is_restep(item) and self._lane.pending:
                    self._lane.reap(block=True)  # its speculative write-back precedes the restore
                self._lane.step(*item)
            else:
                copies = self._copy_grads(*item)
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    pass
                if nxt is not None and nxt is not _STOP and nxt not in self._lane.chunks:
                    try:
                        self._copy_grads(*nxt, block=False)  # its D2H runs while this steps
                    except BaseException:
                        pass  # raised again, and reported, when that chunk is stepped
                self._step_chunk(*item, copies)
        except BaseException as exc:  # surfaced by step()
            lane = False  # nothing of it is pending: it is done (and failed) now
            self._step.fail(exc)
        finally:
            self._step.add_stats(worker_s=time.perf_counter() - t0)
            if not lane:
                self._step.chunk_done()
        self._lane.reap(block=False)
        return nxt

    def _copy_grads(self, g: int, c: int, block: bool = True) -> tuple | None:
        """Issue the D2H copy of chunk ``c``'s gradients into the group's next gradient slot
        (once per chunk and step, and again for a step after a rollback: Note [speculative
        step] in speculate.py; worker thread only).

        Returns ``(the chunk's gradient ring slot or None, {local tensor: has a gradient}, the
        last copy's event or None, {local tensor: flat host gradient} of the pieces stepped in
        place: Note [in-place host chunks], the host copy of the GradScaler's scale to unscale
        the ring by or None: Note [grad scaler overlap] in amp_scaling.py)``, or None when
        ``block`` is False and the gradients may not be read yet. Timed: Note [worker phases].
        """
        key = (g, c, self._step.is_restep((g, c)))
        done = self._copies.get(key)
        if done is not None:
            return done
        group = self._layout.groups[g]
        chunk: Chunk = group.plan.chunks[c]
        t_wait = time.perf_counter()
        got = self._step.chunk_grads(g, chunk, block=block)
        clip_wait_s = time.perf_counter() - t_wait
        if got is None:
            return None
        refs, waits = got
        amp = getattr(self._step.speculation, "amp", None)  # Note [grad scaler overlap]
        scale = amp.scale_to_copy((g, c)) if amp is not None else None
        t_wait = time.perf_counter()
        if not host_grads_landed(refs, block):
            return None  # a streamed gradient's D2H is in flight: copied when this chunk steps
        t_copy = time.perf_counter()
        has_grad = {p: ref is not None for p, ref in refs.items()}
        direct = in_place_grads(group, chunk, refs, native_available(), scaled=scale is not None)
        buf, last, nbytes, ring_bytes, scale_host = None, None, 0, 0, None
        if len(direct) < sum(has_grad.values()):  # some pieces go through the ring
            slot = group.grad_next
            group.grad_next = (slot + 1) % GRAD_SLOTS  # the slot's last chunk has been stepped
            buf = group.grad_ring[slot][:chunk.numel]
            pairs, read_host, read_copied = [], [], []  # read_*: (local tensor, piece)
            for pc in chunk.pieces:
                if refs[pc.param] is None or pc.param in direct:
                    continue
                rel = pc.flat_offset - chunk.flat_start
                grad = refs[pc.param][0][pc.start:pc.start + pc.numel]
                if pc.param in group.host_copies:
                    ring_bytes += pc.numel * buf.element_size()
                if self._copier.cuda and grad.device.type == "cpu":  # a streamed one's, landed
                    buf[rel:rel + pc.numel].copy_(grad)  # Note [streamed write-back]
                    read_host.append((pc.param, grad))
                    continue
                pairs.append((buf[rel:rel + pc.numel], grad))
                read_copied.append((pc.param, grad))
                nbytes += pc.numel * buf.element_size()
            if scale is not None:  # also alone: streamed gradients copied host to host
                pairs.append(scale)  # the scale the loss was scaled by, read with the grads
                scale_host = scale[0]
            last = self._copier.d2h_many(pairs, after=waits or None) if pairs else None
            # Note [gradient writes after a forward-synced step]: what these copies read
            self._step.reads.read(g, c, read_host, None)
            self._step.reads.read(g, c, read_copied,
                                  self._copier.d2h_stream if self._copier.cuda else None)
        in_place = sum(grad[0].element_size() * pc.numel for pc in chunk.pieces
                       if (grad := refs[pc.param]) is not None and pc.param in direct)
        self._step.add_stats(d2h_bytes=nbytes, copy_wait_s=t_copy - t_wait,
                             clip_wait_s=clip_wait_s, grad_copy_s=time.perf_counter() - t_copy,
                             ring_copy_bytes=ring_bytes, in_place_bytes=in_place)
        done = (buf, has_grad, last, direct, scale_host)
        self._copies[key] = done
        return done

    def _step_chunk(self, g: int, c: int, copies: tuple) -> None:
        """Step chunk ``c`` of group ``g`` from ``copies`` (``_copy_grads``'s); timed: Note
        [worker phases] (worker thread)."""
        layout = self._layout
        group = layout.groups[g]
        chunk: Chunk = group.plan.chunks[c]
        grad, has_grad, copied, direct, scale = copies
        t_wait = time.perf_counter()
        if copied is not None:
            copied.synchronize()  # the CPU reads the gradient bytes of this chunk's D2H
        wait_s = time.perf_counter() - t_wait
        key = group.chunk_keys[c]
        t_state = time.perf_counter()
        blob = layout.store.get(key, "cpu", hold=True)
        try:
            self._step.prepare_state((g, c), blob)  # Note [speculative step]: copy or restore
            master, exp_avg, exp_avg_sq = state_views(blob, chunk.numel, layout.moments_dtype)
            self._read_ahead.after(g, c)
            state_s = time.perf_counter() - t_state
            calls = kernel_calls(group, chunk, has_grad, direct)
            if scale is not None:  # Note [grad scaler overlap]: as GradScaler.unscale_ would
                self._step.speculation.amp.unscale_copies(
                    (g, c), [grad[start:start + n] for start, n, _, pc in calls if pc is None],
                    scale)
            out, slot = None, None
            if any(pc is None for *_, pc in calls):  # some pieces go through the rings
                t_wait = time.perf_counter()
                out, slot = self._out_slot(group, chunk.numel)
                wait_s += time.perf_counter() - t_wait
            hp = self._step.hyperparams(g, self._param_groups)
            beta1, beta2 = hp["betas"]
            t0 = time.perf_counter()
            sums: dict[tuple[int, int], int | None] = {}  # (local tensor, start) -> its sum
            for start, numel, step, pc in calls:
                end = start + numel
                sum_as = None
                if pc is None:
                    g_in, p_out = grad[start:end], out[start:end]
                else:  # Note [in-place host chunks]: the host gradient and host copy themselves
                    g_in = direct[pc.param][pc.start:pc.start + numel]
                    whole = local_view(group, pc.param)
                    p_out = whole[pc.start:pc.start + numel]
                    # the kernel sums what it writes (Note [streamed write-back checksums])
                    sum_as = (whole, pc.start) if layout.watch.active else None
                s = adam_step_unchecked(master[start:end], g_in, exp_avg[start:end],
                                        exp_avg_sq[start:end], step=step,
                                        lr=float(hp["lr"]), beta1=beta1, beta2=beta2,
                                        eps=hp["eps"], weight_decay=hp["weight_decay"],
                                        adamw=hp["adamw"], maximize=hp["maximize"],
                                        param_out=p_out, offset=0, numel=numel,
                                        num_threads=self._cpu_threads, sum_as=sum_as)
                if sum_as is not None:
                    sums[(pc.param, pc.start)] = s
            adam_s = time.perf_counter() - t0
            self._step.reads.read(g, c, [(pc.param, direct[pc.param][pc.start:pc.start + n])
                                         for _, n, _, pc in calls if pc is not None],
                                  None)  # the kernel read these host gradients in place
            pairs, h2d = [], 0
            for pc in chunk.pieces:
                if not has_grad[pc.param] or pc.param in direct:
                    continue  # no gradient this step (param and state untouched, like torch)
                rel = pc.flat_offset - chunk.flat_start
                pairs.append((local_view(group, pc.param)[pc.start:pc.start + pc.numel],
                              out[rel:rel + pc.numel]))
                h2d += pc.numel * out.element_size()
            with layout.watch.writing((g, pc.param) for pc in chunk.pieces
                                      if has_grad[pc.param]):  # Note [param changes]
                last = self._copier.h2d_many(pairs)
            # host copies: in place summed by the kernel, the rest summed now
            # (Note [streamed write-back checksums])
            layout.watch.pieces_written(g, [(pc.param, pc.start, pc.numel) for pc in chunk.pieces
                                            if has_grad[pc.param]], known=sums)
            self._step.add_stats(cpu_adam_s=adam_s, copy_wait_s=wait_s, h2d_bytes=h2d, chunks=1,
                                 state_s=state_s, write_back_s=time.perf_counter() - t0 - adam_s)
            if slot is not None:
                group.out_events[slot] = last
        finally:
            layout.store.release(key)
        if (g, c) in layout.nvme_chunks:
            t_back = time.perf_counter()
            layout.store.evict(key, "nvme")  # write-back overlaps the next chunk's compute
            self._step.add_stats(write_back_s=time.perf_counter() - t_back)
        self._step.chunk_issued((g, c), last)

    @staticmethod
    def _out_slot(group: Group, numel: int) -> tuple[torch.Tensor, int]:
        """The next param-out ring slot (``numel`` elements) and its index; worker thread only."""
        slot = group.out_next
        group.out_next = (slot + 1) % OUT_SLOTS
        if group.out_events[slot] is not None:
            group.out_events[slot].synchronize()  # the slot's last H2D must finish before reuse
        return group.out_ring[slot][:numel], slot
