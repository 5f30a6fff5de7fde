"""HybridAdam's speculative CPU step under gradient clipping (Note [speculative step]): the
rollback store (pre-step copies of chunk state within ``rollback_bytes``), the decision at the
end of backward, and the switch that turns speculation off while steps keep clipping (Note
[speculation switch]).

Note [speculative step]: with ``max_grad_norm`` the offloaded chunks cannot be stepped before
the global norm is known (Note [hybrid step] in hybrid_adam.py), so without speculation the CPU
step starts only in ``step()``. With ``rollback_bytes > 0`` (``overlap=True``, not FSDP2) a
chunk whose gradients are complete before ``step()`` has the norm is *admitted* by the worker
when a rollback slot is free (one slot holds the largest chunk's state blob: fp32 master and
both moments): it copies the chunk's state blob into the slot, then steps the chunk exactly as
without clipping (coefficient 1: the gradients as backward left them). Chunks that find no free
slot wait for the norm, as without speculation. ``step()`` computes the norm and torch's
coefficient ``clamp(max_norm / (norm + 1e-6), max=1)`` on the caller's stream, as
``clip_grad_norm_`` does, and reads it (one host synchronisation: the end of backward):
- coefficient exactly 1 (the norm is finite and at most ``max_norm`` less the 1e-6): clipping
  would multiply every gradient by 1, which changes no bit, so the speculative steps stand and
  the waiting chunks read the gradients unclipped: bit-identical to clipping first;
- otherwise (clipped, or a norm of inf/nan, whose coefficient is 0/nan as in torch): admission
  closes, ``step()`` waits until every admitted chunk has been issued (its gradients read: the
  caller's stream waits on those reads before it scales the gradients in place), clips exactly
  as without speculation, and re-queues the admitted chunks; the worker restores each one's
  state blob from its slot (master and moments; a lane chunk after its write-back finished)
  and steps it again with the clipped gradients, writing its params anew. Step counts advance
  only once the step completes, so they need no restore. The result is today's clipped step,
  bit for bit. A re-queued chunk is not admitted again (:meth:`Speculation.admit`): it waits
  for ``step()`` to allow the step, and its gradient copy then waits for the clip's event.
  It used to count as admitted, so a worker that took it between the re-queue and that
  allowance copied it after the gradients' own events only: on CUDA the copy could read the
  gradients before the clip (and a GradScaler's unscale) queued on the caller's stream had
  run, and stepped the unclipped ones (the H200, 4 test processes on one GPU: 1.36 from
  AdamW's weights where 0.02 was the bound; tests/optim/test_speculate_restep.py).
A ``step()`` that refuses the step (a non-finite hyper-parameter, a parameter changed after its
gradient hook: Note [param changes]) puts the admitted chunks back (:meth:`Speculation.undo`):
a refused step is not applied, as without speculation. Under a GradScaler the same slots let
chunks step before the scaler's verdict, also without clipping, the GPU lane's too (each
unscales its own gradient copy: Note [lane unscale] in gpu_lane.py); a skipped (inf/NaN) step
puts them back with :meth:`Speculation.undo` (Note [grad scaler overlap] in amp_scaling.py).

Note [lane rollback on the GPU]: a chunk of the GPU lane (Note [gpu lane]) has its pre-step
state on the device anyway, in the lane slot its state blob was loaded into, so its copy is
kept there: a device-to-device copy of that slot before the fused Adam (on the lane stream,
~0.1 ms for a 16M-element chunk), and a rollback restores the slot from it instead of loading
the blob, which the speculative write-back has overwritten. A host copy instead costs the
worker a memcpy of the chunk's state (~8 ms for 190 MB on the H200 host) while the lane's
own work per chunk is only issuing copies: on the H200 bench the lane row's worker time went
from 128 to 270 ms and only 17 chunks a step were stepped during backward (the worker's
memcpy, not the budget of 21, set the pace). The budget is one: ``rollback_bytes //
(largest chunk's state bytes)`` slots, of which as many are on the GPU as there are lane
chunks among the first that many chunks of the speculating (backward) order -- the chunks a
speculating step admits first -- and the rest in host RAM; a lane chunk finding no device slot
free takes a host slot (the worker's memcpy). No device room for its slots (out of memory):
all slots go to host RAM, logged. ``held_bytes`` counts both places; ``gpu_held_bytes`` the
device's (``HybridAdam.memory_bytes()["gpu"]`` includes them through the lane). Under a
GradScaler the lane's chunks take these slots as under clipping (Note [lane unscale] in
gpu_lane.py): a skipped (inf/NaN) step restores each from its slot (:meth:`Speculation.undo`),
another scale than ``step()``'s or a clip coefficient other than 1 steps it again from it;
``rollback_bytes=0``: they wait for the verdict.
The cost: a memcpy of the chunk's state (12 B/param with fp32 moments, 8 with bf16) per admitted
chunk and step, ``rollback_bytes`` of host RAM (pageable: only the CPU reads it), one host
synchronisation on the norm in ``step()``, and on a clipped step the admitted chunks stepped
twice (the second time after backward, serialised like the non-speculative path). Speculation
speculates in one process, with streamed weights (Note [streamed rollback]) and with ZeRO
``data_parallel``: the coefficient comes from the all-reduced norm, the same bits on every
rank, so every rank decides alike (and its switch follows the same outcomes); each rank admits
and rolls back only its own chunks (how many it admits before the norm is its own timing), and
the norm's all-reduce, which every rank runs on every clipping step, is settle's only
collective. FSDP2 assigns every gradient in ``step()``: nothing to speculate on (refused,
logged). A refused step's :meth:`Speculation.undo` is tested in one process only. HybridAdam
steps chunks in forward order whenever a step does not speculate (ZeRO: the order its buckets
are reduced in, as without speculation).

Note [streamed rollback]: with streamed weights (Note [streamed write-back] in streamed.py) a
speculative step writes the updated weights into the store's host copy that the next pass
streams (in place: Note [in-place host chunks] in chunk_worker.py), not into a param the next
step overwrites anyway; the rollback needs nothing more than in one process: the restored
chunk is stepped again and writes every weight the speculative step wrote (the same pieces:
those with a gradient), and ``Link.before_pass`` marks it changed once the step is complete
(``tier="nvme"``: the NVMe copy is rewritten then). A refused step (:meth:`Speculation.undo`)
writes the restored masters into the host copies, rounded: the weights as before the step,
bit for bit (a weight is its master rounded), and the step counts have not moved, so nothing is
marked changed and the NVMe copy, never rewritten, is still the weights'. The clip of the
streamed weights' host gradients is settle's (:func:`clip_`), after ``step()`` has waited for
every admitted chunk's reads: the worker reads a single-piece chunk's host gradient in place
during its kernel, so a clip in ``grads_and_norm`` (where it was before) would scale it under a
speculative step that is still reading it.

Note [host clip by one]: torch's clip multiplies every gradient by the coefficient, 1 included.
:func:`clip_` copies the coefficient to the host for the host gradients (streamed weights'), a
copy that waits for the norm as it always did, and skips their multiply when it is exactly 1:
then the norm is finite, so is every element, and ``x * 1`` is ``x`` for every finite float
(-0 and subnormals too, in the default IEEE mode; ``torch.set_flush_denormal(True)`` would
have flushed subnormals in the multiply). The bits are those of the multiply, without a pass
over every host gradient on a step that does not speculate (``rollback_bytes=0``, or the switch
off) and does not clip: the reasoning that lets a speculative step stand. Device gradients are
multiplied as before (reading the coefficient there would add a host synchronisation).

Note [held chunks]: a speculating step ships gradients as they land (backward order: the last
layers first), and the chunks that find no slot wait for the norm. Queued behind the admitted
ones they would be stepped, once ``step()`` has the norm, in that backward order -- the order
the next forward needs them *last*: with ``param_sync="forward"`` its first offloaded blocks
would wait for nearly the whole CPU step (the non-speculating path steps them in forward order:
Note [stepping order]). So only as many chunks as there are slots are queued during backward
(:meth:`Speculation.claim`, counting them as :meth:`Speculation.admit` takes slots); the rest
are held, and ``step()`` queues them once it has decided, in forward order (ahead of any
rolled-back chunks), or, with NVMe-resident chunks, in the order they were held, the one the
NVMe read-ahead follows (``StateLayout.expected_order``). The order of the steps changes no
bit (each chunk's step reads only its own state and gradients).

Note [speculation switch]: a clipped step costs a rollback and a second CPU step of every
admitted chunk, so speculation pays only while clipping is rare. Every step's outcome (clipped:
the coefficient is not exactly 1) is recorded, also on steps that did not speculate (their
coefficient is copied to the host without a synchronisation and read when the next step
begins). A step speculates when at most ``SWITCH_MAX_CLIPPED`` of the last ``SWITCH_WINDOW``
steps clipped: two clipped steps in four turn it off (a run that always clips rolls back at
most two steps), and it comes back once three of the last four did not clip.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import torch

from tiermem._log import logger
from tiermem.optim.amp_scaling import SCALER_MODES, ScalerState
from tiermem.optim.layout import (StateLayout, chunk_state_bytes, local_view, state_numel,
                                  state_views)
from tiermem.optim.step_state import StepState

SWITCH_WINDOW = 4
"""Steps whose outcome decides whether the next step speculates (Note [speculation switch])."""

SWITCH_MAX_CLIPPED = 1
"""The most clipped steps among the last ``SWITCH_WINDOW`` with which a step still speculates."""

SPECULATING_MODES = ("local", "local+stream", "zero")
"""The modes whose steps speculate (Note [speculative step], Note [streamed rollback])."""


def clip_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the clip coefficient ``coef``, per device: a streamed
    weight's host gradient by a host copy of it (Note [streamed rollback]); host gradients not
    at all when that copy is exactly 1 (Note [host clip by one]).

    Raises:
        Nothing beyond torch's errors.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in grads:
        by_device.setdefault(t.device, []).append(t)
    for device, ts in by_device.items():
        c = coef if device == coef.device else coef.to(device)  # host: waits for the norm
        if c.device.type == "cpu" and float(c) == 1.0:
            continue  # Note [host clip by one]
        torch._foreach_mul_(ts, c)


class SpeculationSwitch:
    """Note [speculation switch]: whether the next step speculates, from recent outcomes."""

    def __init__(self) -> None:
        """Raises: Nothing."""
        self._recent: collections.deque = collections.deque(maxlen=SWITCH_WINDOW)

    def record(self, clipped: bool) -> None:
        """Record one step's outcome (``clipped``: its coefficient was not exactly 1).

        Raises:
            Nothing.
        """
        self._recent.append(bool(clipped))

    def on(self) -> bool:
        """Whether the next step speculates.

        Raises:
            Nothing.
        """
        return sum(self._recent) <= SWITCH_MAX_CLIPPED


class Speculation:
    """The rollback store and this step's admissions (Note [speculative step]).

    Threads: the caller (``begin_step``, ``settle``), the worker (``admit`` via
    ``StepState.chunk_grads``, ``prepare``, ``lane_copy``, ``lane_scale_read``,
    ``is_restep``). ``_admitted``, ``_admitted_gpu``, ``_decided`` and ``_restore`` are under
    the step's lock; ``_saved`` and ``_lane_scales`` under ``_lock``.

    Attributes:
        enabled: speculation can happen (``rollback_bytes > 0``, clipping, overlap, a mode of
            ``SPECULATING_MODES``).
        active: this step speculates (caller writes it in :meth:`begin_step`, worker idle).
        switch: the :class:`SpeculationSwitch`.
    """

    def __init__(self, layout: StateLayout, step: StepState, read_ahead: Any, *,
                 rollback_bytes: int, clipping: bool, overlap: bool, one_process: bool,
                 who: str, mode: str = "local") -> None:
        """Args: the optimizer's layout, step state and read-ahead, and its ``rollback_bytes``,
        whether it clips, overlaps and runs in one process, its error prefix and its mode's
        name (speculation: ``SPECULATING_MODES``). Logs why speculation is off when
        ``rollback_bytes`` was given in vain.

        Raises:
            Nothing.
        """
        self._layout = layout
        self._step = step
        self._read_ahead = read_ahead
        self.budget_bytes = rollback_bytes
        self.enabled = (rollback_bytes > 0 and clipping and overlap
                        and mode in SPECULATING_MODES)
        if rollback_bytes > 0 and clipping and not self.enabled:
            why = ("overlap=False steps every chunk in step()" if not overlap else
                   "FSDP2 assigns every gradient in step(): nothing lands before the norm"
                   if mode == "fsdp" else f"not with {mode!r} params")
            logger.info("%s: rollback_bytes=%d but the step does not speculate (%s): chunks "
                        "wait for the gradient norm (Note [speculative step])", who,
                        rollback_bytes, why)
        if self.enabled:  # the split tier's RAM and the lane's share follow the speculating order
            layout.backward_order = True
        self.active = False
        self._mode = mode
        self._overlap = overlap
        self.scaler = False  # a GradScaler drives the steps (Note [grad scaler overlap])
        self.amp = ScalerState(self, supported=overlap and mode in SCALER_MODES)
        self.undone = 0  # chunks the last undo() restored
        self.undone_items: frozenset = frozenset()  # which (check_accumulation's message)
        self.switch = SpeculationSwitch()
        self._slots: list[torch.Tensor] = []  # host slots
        self._allocated = False  # _alloc ran (at the first step with state)
        self._lane: Any = None  # the GpuLane (bind_lane): its chunks, its device slots
        self._admitted: dict[tuple[int, int], int] = {}  # item -> host slot
        self._admitted_gpu: dict[tuple[int, int], int] = {}  # lane item -> device slot
        self._decided = False
        self._restore: set[tuple[int, int]] = set()
        self._saved: set[tuple[int, int]] = set()
        self._lane_scales: dict[tuple[int, int], tuple] = {}  # Note [lane unscale] (gpu_lane.py)
        self._claimed = [0, 0]  # slots claimed by queued chunks: host, GPU (Note [held chunks])
        self._held: list[tuple[int, int]] = []  # chunks queued by step() (Note [held chunks])
        self._outcome: tuple | None = None  # (host coefficient, event or None)
        self._lock = threading.Lock()  # _saved, _lane_scales: worker writes, caller reads

    def bind_lane(self, lane: Any) -> None:
        """The optimizer's :class:`~tiermem.optim.gpu_lane.GpuLane`, whose chunks keep their
        copies on the GPU (Note [lane rollback on the GPU]); called once by the lane.

        Raises:
            Nothing.
        """
        self._lane = lane

    def enable_scaler(self) -> None:
        """A GradScaler drives the steps (caller's thread, in ``step()``): from the next step
        on, chunks are admitted before ``step()`` has its verdict also without clipping, the
        GPU lane's too (Note [lane unscale] in gpu_lane.py; Note [grad scaler overlap] in
        ``amp_scaling.py``); one process (``SCALER_MODES``: streamed weights too) only.

        Raises:
            Nothing.
        """
        if self.budget_bytes > 0 and self._overlap and self._mode in SCALER_MODES:
            self.enabled = self.scaler = True

    def admitted_early(self, item: tuple[int, int]) -> bool:
        """Whether chunk ``item`` reads its gradients now as an admitted chunk of a speculative
        step (a host slot or, on the GPU lane, a device slot), before ``step()`` decided (not
        stepped again after a rollback); worker thread.

        Raises:
            Nothing.
        """
        with self._step.lock:
            return ((item in self._admitted or item in self._admitted_gpu)
                    and item not in self._restore)

    def lane_scale_read(self, item: tuple[int, int], host: torch.Tensor, event: Any) -> None:
        """Lane chunk ``item`` unscaled its gradient copy by the scale being copied into
        ``host`` (complete once ``event`` is, None: already); :meth:`close` records it for
        ``step()``'s comparison (Note [lane unscale] in gpu_lane.py). Worker thread, before the
        chunk is issued.

        Raises:
            Nothing.
        """
        with self._lock:
            self._lane_scales[item] = (host, event)

    def _record_lane_scales(self, items: list[tuple[int, int]]) -> None:
        """Record the scale each lane chunk of ``items`` unscaled by with the ScalerState, as
        the worker records a host chunk's (caller's thread, the chunks issued)."""
        with self._lock:
            reads = [(item, self._lane_scales.pop(item)) for item in items
                     if item in self._lane_scales]
        for item, (host, event) in reads:
            if event is not None:
                event.synchronize()  # the scale's copy to the host, queued before the step
            self.amp.unscale_copies(item, [], host)  # nothing left to unscale: records it

    def close(self, consumer: Any, wait: bool) -> tuple[list, list]:
        """Close admission (caller's thread, in ``step()``): no chunk is admitted after. With
        ``wait``, wait until every admitted chunk has been issued (its gradients read) and make
        ``consumer`` (the caller's CUDA stream, None on the CPU) wait for its copies, so that
        the gradients may then be written in place. Returns ``(admitted, issued)`` chunks.

        Raises:
            Nothing.
        """
        step = self._step
        with step.idle:
            self._decided = True
            admitted = list(self._admitted) + list(self._admitted_gpu)
            while wait and any(i not in step.chunk_h2d for i in admitted) and not step.errors:
                step.idle.wait()  # an admitted chunk is still reading its gradients
            issued = [i for i in admitted if i in step.chunk_h2d]
            events = [step.chunk_h2d[i] for i in issued]
        for event in events if wait and consumer is not None else ():
            if event is not None:
                consumer.wait_event(event)  # the speculative reads precede in-place writes
        if wait:
            self._record_lane_scales(issued)  # Note [lane unscale]: for ScalerState.differs
        return admitted, issued

    def _gpu_slots(self) -> list[torch.Tensor]:
        """The lane's device rollback slots (none without a lane)."""
        return self._lane.rollback if self._lane is not None else []

    def held_bytes(self) -> int:
        """Bytes of the rollback slots allocated, host RAM and GPU memory together (0 until the
        first step with state; Note [lane rollback on the GPU]).

        Raises:
            Nothing.
        """
        return sum(s.numel() * s.element_size() for s in self._slots) + self.gpu_held_bytes()

    def gpu_held_bytes(self) -> int:
        """Bytes of the rollback slots in GPU memory, for chunks of the GPU lane (Note [lane
        rollback on the GPU]).

        Raises:
            Nothing.
        """
        return sum(s.numel() * s.element_size() for s in self._gpu_slots())

    def free(self) -> None:
        """Give back the rollback slots, host RAM and the lane's device slots (``close()``,
        the worker stopped): a closed optimizer the caller still holds keeps none of
        ``rollback_bytes``; nothing speculates after.

        Raises:
            Nothing beyond torch's errors.
        """
        device = self._layout.device
        if self._gpu_slots() and device.type == "cuda":
            torch.cuda.synchronize(device)  # no lane copy still reads or writes a slot
        self._slots = []
        if self._lane is not None:
            self._lane.rollback = []
        self.enabled = self.active = False

    def _alloc(self) -> None:
        """Allocate ``rollback_bytes // (largest chunk's state bytes)`` slots, at most one per
        chunk (caller's thread, at the first step with state): on the GPU as many as there are
        lane chunks among the first that many chunks of the speculating order, the rest in
        host RAM (Note [lane rollback on the GPU])."""
        layout = self._layout
        chunks = [c for g in layout.groups for c in g.plan.chunks]
        if not chunks:
            return
        slot_bytes = chunk_state_bytes(max(c.numel for c in chunks), layout.moments_dtype)
        n = min(len(chunks), self.budget_bytes // slot_bytes)
        order = [(g.index, c) for g in layout.groups for c in range(len(g.plan.chunks))][::-1]
        lane = self._lane.chunks if self._lane is not None else set()
        n_gpu = sum(1 for item in order[:n] if item in lane)  # backward order: admitted first
        if n_gpu:
            try:
                self._lane.alloc_rollback(n_gpu)
            except torch.OutOfMemoryError:
                logger.info("HybridAdam: no GPU memory for %d rollback slots of the GPU lane "
                            "(%d bytes each): they are kept in host RAM ("
                            "Note [lane rollback on the GPU])", n_gpu, slot_bytes)
                n_gpu = 0
        numel = state_numel(max(c.numel for c in chunks), layout.moments_dtype)
        self._slots = [torch.empty(numel, dtype=torch.float32) for _ in range(n - n_gpu)]
        if not n:
            logger.info("HybridAdam: rollback_bytes=%d holds no chunk's state (%d bytes "
                        "each): no step speculates", self.budget_bytes, slot_bytes)

    def begin_step(self, ready: bool) -> None:
        """Start a step (caller's thread, worker idle): record the last step's deferred outcome,
        decide whether this one speculates (Note [speculation switch]) and set the stepping
        order to match (backward order when it does: Note [stepping order]; also before the
        state is planned, so that the split tier's RAM chunks and the GPU lane's share are
        chosen by the order in which speculating steps take the chunks).

        Args:
            ready: the optimizer's state is allocated (trace placement: after the first step).

        Raises:
            Nothing.
        """
        if not self.enabled:
            return
        if self._outcome is not None:
            coef, event = self._outcome
            if event is not None:
                event.synchronize()  # the coefficient's copy to the host (long done)
            self.switch.record(float(coef) != 1.0)
            self._outcome = None
        if ready and not self._allocated:
            self._allocated = True
            self._alloc()
        with self._step.lock:
            self._admitted.clear()
            self._admitted_gpu.clear()
            self._restore.clear()
            self._claimed = [0, 0]
            self._held = []
            self._decided = False
        with self._lock:
            self._saved.clear()
            self._lane_scales.clear()
        self.active = (ready and bool(self._slots or self._gpu_slots())
                       and self.switch.on())
        # not ready: the first step plans (trace placement); ZeRO ships as buckets are reduced
        order = self.active or not ready or self._mode == "zero"
        if self._layout.backward_order != order:
            self._layout.backward_order = order  # hooks ship as gradients land
            self._read_ahead.plan_changed()

    def admit(self, item: tuple[int, int]) -> bool:
        """Whether chunk ``item`` may be stepped before the norm is known: a rollback slot is
        free and ``step()`` has not decided yet (worker thread, under the step's lock).

        Raises:
            Nothing.
        """
        if item in self._restore:
            return False  # stepped again after a rollback: reads the clipped gradients
        if item in self._admitted or item in self._admitted_gpu:
            return True
        if not self.active or self._decided:
            return False
        if (self._lane is not None and item in self._lane.chunks
                and len(self._admitted_gpu) < len(self._gpu_slots())):
            self._admitted_gpu[item] = len(self._admitted_gpu)  # Note [lane rollback on the GPU]
            return True
        if len(self._admitted) >= len(self._slots):
            return False
        self._admitted[item] = len(self._admitted)
        return True

    def claim(self, item: tuple[int, int]) -> bool:
        """Whether chunk ``item``, complete during backward, goes to the worker's queue now:
        while this step speculates and has not decided, only as many chunks as there are slots
        (of its kind, as :meth:`admit` takes them) are queued; the rest are held for
        :meth:`settle` (Note [held chunks]). Hooks' thread, under the step's lock.

        Raises:
            Nothing.
        """
        if not self.active or self._decided:
            return True
        if item in self._held:
            return False
        lane = self._lane is not None and item in self._lane.chunks
        if lane and self._claimed[1] < len(self._gpu_slots()):
            self._claimed[1] += 1
            return True
        if self._claimed[0] < len(self._slots):
            self._claimed[0] += 1
            return True
        self._held.append(item)
        return False

    def _release_held(self, enqueue: Callable[[tuple[int, int]], None]) -> None:
        """Queue the held chunks (caller's thread, in ``step()``, decided): in forward order
        without NVMe chunks, else in the order they were held (Note [held chunks])."""
        with self._step.lock:
            held, self._held = self._held, []
        for item in (held if self._layout.nvme_chunks else sorted(held)):
            enqueue(item)

    def lane_copy(self, item: tuple[int, int]) -> tuple[torch.Tensor, bool] | None:
        """For a lane chunk admitted to a device slot (Note [lane rollback on the GPU]): ``(the
        slot, restore)`` -- restore: the chunk is stepped again after a rollback, so the lane
        loads its state from the slot; else the lane copies its loaded state into the slot
        before stepping and then calls :meth:`mark_saved`. None: no device slot (the lane
        calls :meth:`prepare` with the blob). Worker thread.

        Raises:
            Nothing.
        """
        with self._step.lock:
            slot = self._admitted_gpu.get(item)
            if slot is None:
                return None
            restore = item in self._restore
            self._restore.discard(item)
        return self._gpu_slots()[slot], restore

    def mark_saved(self, item: tuple[int, int]) -> None:
        """The lane has issued lane chunk ``item``'s copy into its device slot (worker thread):
        :meth:`undo` restores it from there.

        Raises:
            Nothing.
        """
        with self._lock:
            self._saved.add(item)

    def is_restep(self, item: tuple[int, int]) -> bool:
        """Whether chunk ``item`` is queued again after a rollback and not yet restored (worker).

        Raises:
            Nothing.
        """
        with self._step.lock:
            return item in self._restore

    def prepare(self, item: tuple[int, int], blob: torch.Tensor) -> None:
        """Chunk ``item``'s state blob is held in RAM and about to be stepped (worker): keep a
        copy of it when the chunk was admitted, restore it when it is stepped again after a
        rollback.

        Raises:
            Nothing.
        """
        with self._step.lock:
            slot = self._admitted.get(item)
            restore = item in self._restore
            if restore:
                self._restore.discard(item)
        if slot is None:
            return
        copy = self._slots[slot][:blob.numel()]
        if restore:
            blob.copy_(copy)  # Note [speculative step]: master and moments as before the step
        elif item not in self._saved:
            copy.copy_(blob)
            with self._lock:
                self._saved.add(item)

    def undo(self) -> int:
        """``step()`` refused the step (caller's thread, the worker drained): put every chunk
        stepped speculatively back as it was -- its state from its copy, its params from the
        restored masters (those the user has not changed since: a changed one keeps its value,
        which the next step takes into the masters, Note [param changes]); a refused step is
        not applied, as without speculation. Returns the chunks restored.

        Raises:
            StoreClosedError: the store was closed.
        """
        with self._step.lock, self._lock:
            items = ([(item, self._slots[k]) for item, k in self._admitted.items()
                      if item in self._saved]
                     + [(item, self._gpu_slots()[k]) for item, k in self._admitted_gpu.items()
                        if item in self._saved])
            h2d = list(self._step.h2d_events)
        layout = self._layout
        if items and layout.device.type == "cuda":
            for event in h2d:
                if event is not None:  # the speculative params' copies precede the restore
                    torch.cuda.current_stream(layout.device).wait_event(event)
        for (g, c), saved in items:
            group = layout.groups[g]
            chunk, key = group.plan.chunks[c], group.chunk_keys[c]
            blob = layout.store.get(key, "cpu", hold=True)
            try:
                # a lane slot: its copy precedes the write-back the drain waited for
                blob.copy_(saved[:blob.numel()])
                master = state_views(blob, chunk.numel, layout.moments_dtype)[0]
                keep = [pc for pc in chunk.pieces if not layout.watch.changed(g, pc.param)]
                with layout.watch.writing((g, pc.param) for pc in keep):
                    for pc in keep:  # the param a step writes is its master, rounded
                        rel = pc.flat_offset - chunk.flat_start
                        local_view(group, pc.param)[pc.start:pc.start + pc.numel].copy_(
                            master[rel:rel + pc.numel])
            finally:
                layout.store.release(key)
            if (g, c) in layout.nvme_chunks:
                layout.store.evict(key, "nvme").wait()
        self.undone = len(items)
        self.undone_items = frozenset(item for item, _ in items)
        return len(items)

    def settle(self, mode: Any, groups: list, device: torch.device, max_norm: float | None,
               copier: Any, enqueue: Callable[[tuple[int, int]], None],
               redo: bool = False) -> int | None:
        """Clip like ``torch.nn.utils.clip_grad_norm_`` by the global norm (on the caller's
        stream), or let the speculative steps stand (Note [speculative step]); with a rollback,
        re-queue the admitted chunks. ``max_norm`` None: no clipping (a step speculating under
        a GradScaler); ``redo``: roll back even when nothing clips (the speculative steps read
        their gradients under another scale than ``step()`` was given: Note [grad scaler
        overlap] in amp_scaling.py). Caller's thread, in ``step()``; ``compute_allowed`` is
        set by the caller afterwards. Returns the chunks rolled back (None: the step did not
        speculate).

        Raises:
            Nothing of its own.
        """
        step = self._step
        if self.enabled:  # held on every step, also one the switch keeps from speculating
            step.add_stats(rollback_held_bytes=self.held_bytes(),
                           rollback_gpu_bytes=self.gpu_held_bytes(), speculating=int(self.active))
        coef = None
        if max_norm is not None:
            grads, total = mode.grads_and_norm(groups, device)
            counts = getattr(mode, "norm_counts", None)  # Note [streamed gradient norms]
            if counts:
                with step.stats_lock:
                    step.stats.update(counts)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        consumer = copier.consumer_stream()
        items: list[tuple[int, int]] = []
        if self.active:
            clipped = coef is not None and float(coef) != 1.0  # a host sync: end of backward
            if coef is not None:
                self.switch.record(clipped)
            again = clipped or redo
            admitted, items = self.close(consumer, wait=again)
            items = items if again else []
            step.add_stats(speculated_chunks=len(admitted), rolled_back_chunks=len(items))
            if not again:
                self._release_held(enqueue)  # Note [held chunks]
                return 0  # the coefficient is 1: clipping would change no gradient
        elif self.enabled and coef is not None:  # the switch learns it at the next step
            event = None
            host = coef.detach().to("cpu", non_blocking=True)
            if copier.cuda:
                event = torch.cuda.Event()
                event.record(consumer)  # the coefficient's copy to the host
            self._outcome = (host, event)
        if coef is not None:
            clip_(grads, coef)  # after the admitted chunks' reads: Note [streamed rollback]
            if copier.cuda:
                clip_event = torch.cuda.Event()
                clip_event.record(consumer)  # D2H copies and the lane read clipped grads
                step.clip_event = clip_event
        self._release_held(enqueue)  # Note [held chunks]: before the rolled-back ones
        if not items:
            return 0 if self.active else None
        with step.lock:
            for item in items:  # Note [forward sync]: the forward waits for the new step
                step.chunk_h2d.pop(item, None)
                step.queued.discard(item)
            self._restore.update(items)
        for item in items:
            enqueue(item)
        return len(items)
