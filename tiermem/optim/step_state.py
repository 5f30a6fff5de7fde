"""The mutable state of one HybridAdam step that several threads share: the caller's thread
(``step()``, ``_begin_step``, the forward pre-hook), autograd's threads (the gradient hooks) and
the chunk worker thread. Every field says which thread writes it and under which lock.

Note [frozen hyper-parameters]: a chunk is stepped with one copy of its group's hyper-parameters,
taken once when the worker starts it: the live ``param_groups`` copied under ``lock`` before
``step()``, the copy ``step()`` froze (under the same lock) after it. With
``param_sync="forward"`` the worker is still stepping chunks after ``step()`` returns, while the
training loop's ``scheduler.step()`` already changes the live values. Reading the live dict
itself (it once did, holding a reference taken before ``step()``, and reading ``lr`` from it
later) let a chunk begun during backward be stepped with the next step's learning rate when the
worker thread was descheduled between the two: found as a rare 1e-5 loss difference under CPU
load (``tests/optim/test_hybrid_adam.py::test_gpu_lane_parity_with_torch_adamw``, forward sync),
reproduced by logging each chunk's ``lr`` (the next step's, with the right step count);
``tests/optim/test_frozen_hyperparams.py`` forces the interleaving.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem.optim.grad_reads import ReadGuard
from tiermem.optim.hyperparams import check_group, hp_differences
from tiermem.optim.partition import Chunk


def new_stats() -> dict:
    """A step's counters at zero (seconds, bytes, chunks: see ``HybridAdam.step_stats``; the
    worker's phases ``clip_wait_s``, ``grad_copy_s``, ``state_s``, ``write_back_s``: Note
    [worker phases] in chunk_worker.py; ``in_place_bytes`` / ``ring_copy_bytes``: Note
    [in-place host chunks] there).

    Raises:
        Nothing.
    """
    return {"cpu_adam_s": 0.0, "worker_s": 0.0, "copy_wait_s": 0.0, "clip_wait_s": 0.0,
            "grad_copy_s": 0.0, "state_s": 0.0, "write_back_s": 0.0, "in_place_bytes": 0,
            "ring_copy_bytes": 0, "d2h_bytes": 0,
            "h2d_bytes": 0, "stall_s": 0.0, "chunks": 0, "gpu_chunks": 0,
            "speculated_chunks": 0, "rolled_back_chunks": 0, "rollback_held_bytes": 0,
            "rollback_gpu_bytes": 0, "speculating": 0}


def _copy_hp(group: dict) -> dict:
    """A param group's hyper-parameters (not its params), copied: a tensor value (an LR a
    scheduler fills in place) is cloned.

    Raises:
        Nothing.
    """
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in group.items() if k != "params"}


@dataclass
class StepState:
    """One step's cross-thread state; ``reset`` (caller's thread, worker idle) starts the next.

    Threads: *caller* (the one calling ``step()``, ``zero_grad``, ``state_dict``, the forward
    pre-hook), *hooks* (autograd's, running the post-accumulate-grad hooks; on the caller's
    thread in ``step()`` for gradients no hook shipped), *worker* (the chunk worker thread).
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards every field below marked "under lock"; also HybridAdam's ``_arrived``."""
    idle: threading.Condition = field(init=False)
    """On ``lock``: notified when ``outstanding`` drops or a chunk's params are issued H2D."""
    compute_allowed: threading.Event = field(default_factory=threading.Event)
    """Written by the caller: set when gradients may be read (with ``max_grad_norm``, once
    ``step()`` has clipped them); the worker waits on it before touching a chunk's gradients."""
    acc_count: dict[tuple[int, int], int] = field(default_factory=dict)
    """Under lock; hooks write: backward passes accumulated per ``(group, local tensor)``."""
    shipped: set[tuple[int, int]] = field(default_factory=set)
    """Under lock; hooks write: local tensors whose gradient was handed to the offloaded side."""
    shipped_versions: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """Under lock; hooks write: a shipped gradient's ``(_version, data_ptr, checksum)``
    (one process; ``grad_sums.shipped_mark``, Note [gradient checksums])."""
    grad_refs: dict[tuple[int, int], tuple | None] = field(default_factory=dict)
    """Under lock; hooks write, the worker reads: ``(g, i)`` -> (flat gradient, event marking it
    complete) or None (no gradient this step)."""
    chunk_missing: dict[tuple[int, int], int] = field(default_factory=dict)
    """Under lock; hooks write: gradients each ``(group, chunk)`` still waits for."""
    queued: set[tuple[int, int]] = field(default_factory=set)
    """Under lock; hooks write, the worker reads: chunks handed to the worker this step."""
    read_ahead: set[tuple[int, int]] = field(default_factory=set)
    """Under lock; the caller (first chunks) and the worker write: NVMe chunks prefetched,
    not yet stepped."""
    outstanding: int = 0
    """Under lock; hooks add a queued chunk, the worker takes away a finished one."""
    errors: list[BaseException] = field(default_factory=list)
    """Under lock; the worker appends, the caller takes them in ``_finish_step``."""
    h2d_events: list = field(default_factory=list)
    """Under lock; the worker appends: events of the updated params' H2D copies (and lane
    steps) the caller's stream waits on."""
    chunk_h2d: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Under lock; the worker writes: stepped chunk -> its last H2D event (Note [forward sync]
    in forward_sync.py)."""
    clip_event: Any = None
    """No lock; the caller writes it before setting ``compute_allowed``, the worker reads it
    after waiting on that: the clip's event, the gradients' copies wait for it."""
    frozen_hp: list[dict] | None = None
    """Under lock; the caller writes (:meth:`freeze` in ``step()``, :meth:`reset`), the worker
    reads (:meth:`hyperparams`): each group's hyper-parameters as of ``step()`` (None before
    it: the live ``param_groups``). See Note [frozen hyper-parameters]."""
    early_hp: dict[int, list[dict]] = field(default_factory=dict)
    """Under lock; the worker writes (:meth:`hyperparams` before ``step()`` froze them): each
    group's distinct hyper-parameters chunks were stepped with before ``step()`` (Note [late
    hyper-parameters] in hyperparams.py)."""
    backward_hp: list[dict] | None = None
    """Under lock; the hooks write (:meth:`note_backward`, the step's first gradient hook):
    every group's hyper-parameters when backward began."""
    backward_seen: bool = False
    """No lock; the hooks set it (:meth:`note_backward`), ``step()`` and :meth:`reset` clear it:
    a backward ran since the last ``step()`` (Note [skipped steps] in step_checks.py)."""
    abandoned: bool = False
    """Written by the caller (:meth:`abandon`, :meth:`reset`) before setting
    ``compute_allowed``, read by the worker after waiting on it: the step was refused, step no
    chunk of it."""
    speculation: Any = None
    """Set once by HybridAdam: its :class:`~tiermem.optim.speculate.Speculation`, which admits
    chunks before ``step()`` has the norm (Note [speculative step] in speculate.py)."""
    reads: ReadGuard = field(default_factory=ReadGuard)
    """Its own lock; the worker and the lane record their gradient reads, the caller marks and
    compares them (Note [gradient writes after a forward-synced step] in grad_reads.py)."""
    stats_lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``stats``."""
    stats: dict = field(default_factory=new_stats)
    """Under stats_lock; the worker adds to it, the caller replaces it: this step's counters."""

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)

    def reset(self, chunk_missing: dict[tuple[int, int], int]) -> None:
        """Start a step (caller's thread, worker idle): clear the per-step fields under the
        lock, with ``chunk_missing`` the gradients each chunk waits for; drop the clip event and
        the frozen hyper-parameters.

        Raises:
            Nothing.
        """
        with self.lock:
            self.frozen_hp = None
            self.early_hp = {}
            self.backward_hp = None
            self.backward_seen = False
            self.acc_count.clear()
            self.shipped.clear()
            self.shipped_versions.clear()
            self.grad_refs.clear()
            self.chunk_h2d.clear()
            self.queued.clear()
            self.h2d_events = []
            self.chunk_missing = chunk_missing
        self.reads.reset()  # Note [gradient writes after a forward-synced step]
        self.clip_event = None
        self.abandoned = False

    def abandon(self) -> None:
        """Give up this step (caller's thread, ``step()`` refused it): every chunk queued or
        still to come fails instead of stepping, then :meth:`drain` returns, chunks stepped
        speculatively are restored, the errors are dropped and the caller resets the step.

        Raises:
            Nothing.
        """
        if self.abandoned:
            return  # given up already: drained, speculated chunks put back (idempotent)
        self.abandoned = True
        self.compute_allowed.set()  # chunks waiting for the clip wake up and fail
        self.drain()
        if self.speculation is not None:
            self.speculation.undo()  # Note [speculative step]: chunks stepped early go back
        with self.lock:
            self.errors.clear()

    def chunk_grads(self, g: int, chunk: Chunk, block: bool = True
                    ) -> tuple[dict[int, tuple | None], list] | None:
        """Chunk ``chunk`` of group ``g``'s gradients once they may be read: ``({local tensor:
        (flat gradient, event) or None}, the events a copy or step of them must wait for)`` --
        the clip's, with clipping, else each gradient's own. With clipping, blocks until
        ``step()`` has clipped unless the chunk is admitted to a speculative step (Note
        [speculative step] in speculate.py); with ``block=False`` returns None instead of
        blocking. Worker thread.

        Raises:
            RuntimeError: ``step()`` abandoned the step (:meth:`abandon`).
        """
        early = False
        if not self.compute_allowed.is_set():
            with self.lock:
                early = self.speculation is not None and self.speculation.admit(
                    (g, chunk.index))
            if not early:
                if not block:
                    return None
                self.compute_allowed.wait()  # with clipping: step() has clipped the gradients
        if self.abandoned:
            raise RuntimeError("HybridAdam: this step was refused by step(); chunk not stepped")
        with self.lock:
            refs = {pc.param: self.grad_refs.get((g, pc.param)) for pc in chunk.pieces}
        if self.clip_event is not None and not early:
            return refs, [self.clip_event]  # the clipped gradients are complete here
        return refs, list(dict.fromkeys(ref[1] for ref in refs.values()
                                        if ref is not None and ref[1] is not None))

    def freeze(self, live: list[dict]) -> None:
        """Fix every group's hyper-parameters as of now (``step()``, caller's thread): chunks
        stepped from here on use them even when an LR scheduler changes ``live`` (the
        optimizer's ``param_groups``) before the worker is done. Note [frozen hyper-parameters].

        Raises:
            Nothing.
        """
        frozen = [_copy_hp(hp) for hp in live]
        with self.lock:
            self.frozen_hp = frozen

    def hyperparams(self, g: int, live: list[dict]) -> dict:
        """Group ``g``'s hyper-parameters for one chunk, a copy the caller may not change: as of
        ``step()`` once it has frozen them, else ``live[g]`` copied now (worker thread; read
        once per chunk). Note [frozen hyper-parameters].

        Raises:
            ValueError: a live value is not finite or out of range, or amsgrad is asked for
                (Note [finite hyper-parameters] in ``tiermem/optim/hyperparams.py``).
        """
        with self.lock:
            if self.frozen_hp is not None:
                return self.frozen_hp[g]
            hp = _copy_hp(live[g])  # under the lock: step() cannot freeze, then a scheduler
            # change the live values, between the check and the copy
            seen = self.early_hp.setdefault(g, [])  # Note [late hyper-parameters]
            if not any(not hp_differences(g, old, hp) for old in seen):
                seen.append(hp)
        check_group("HybridAdam", g, hp)  # Note [finite hyper-parameters]: before any use
        return hp

    def note_backward(self, live: list[dict]) -> None:
        """Record every group's hyper-parameters as backward begins, once a step (the first
        gradient hook; Note [late hyper-parameters] in hyperparams.py).

        Raises:
            Nothing.
        """
        self.backward_seen = True  # Note [skipped steps] in step_checks.py
        if self.backward_hp is None:  # unlocked read: only the hooks' thread writes it
            copied = [_copy_hp(hp) for hp in live]
            with self.lock:
                self.backward_hp = copied

    def late_changes(self) -> tuple[list[str], list[str]]:
        """After :meth:`freeze` (``step()``): ``(stale, late)``, the hyper-parameters that differ
        from the frozen ones in what chunks stepped before ``step()`` read (``stale``: those
        chunks are wrong) and in what backward began with (``late``: the loop sets them after
        backward). Note [late hyper-parameters] in hyperparams.py.

        Raises:
            Nothing.
        """
        with self.lock:
            frozen, early, began = self.frozen_hp, dict(self.early_hp), self.backward_hp
        if frozen is None:
            return [], []
        stale = [d for g, seen in sorted(early.items()) for hp in seen
                 for d in hp_differences(g, hp, frozen[g])]
        late = [d for g, hp in enumerate(began or []) if g < len(frozen)
                for d in hp_differences(g, hp, frozen[g])]
        return list(dict.fromkeys(stale)), late

    def prepare_state(self, item: tuple[int, int], blob: Any) -> None:
        """Chunk ``item``'s state blob is held in RAM, about to be stepped (worker): the
        speculation keeps or restores its copy (Note [speculative step] in speculate.py).

        Raises:
            Nothing.
        """
        if self.speculation is not None:
            self.speculation.prepare(item, blob)

    def is_restep(self, item: tuple[int, int]) -> bool:
        """Whether chunk ``item`` is queued again after a rollback, not yet restored (worker).

        Raises:
            Nothing.
        """
        return self.speculation is not None and self.speculation.is_restep(item)

    def add_stats(self, **deltas: float) -> None:
        """Add ``deltas`` (seconds, bytes, chunks) to this step's counters (any thread).

        Raises:
            Nothing.
        """
        with self.stats_lock:
            for name, value in deltas.items():
                self.stats[name] += value

    def fail(self, exc: BaseException) -> None:
        """Record a worker error; ``step()`` raises it (worker thread).

        Raises:
            Nothing.
        """
        with self.lock:
            self.errors.append(exc)

    def chunk_done(self) -> None:
        """One queued chunk is finished (worker thread): wake whoever waits for them all.

        Raises:
            Nothing.
        """
        with self.idle:
            self.outstanding -= 1
            self.idle.notify_all()

    def chunk_issued(self, item: tuple[int, int], event: Any) -> None:
        """Chunk ``item``'s params are updated once ``event`` (None: already) is reached
        (worker thread): the caller's stream will wait on it.

        Raises:
            Nothing.
        """
        with self.idle:
            if event is not None:
                self.h2d_events.append(event)
            self.chunk_h2d[item] = event
            self.idle.notify_all()  # a forward may wait for this chunk (Note [forward sync])

    def drain(self, what: str | None = None) -> None:
        """Wait until the worker has finished every queued chunk (caller's thread); with
        ``what`` (reading or loading the state, named so), first refuse it while chunks of a
        step that ``step()`` has not taken yet were handed to the worker.

        Note [state between steps]: with ``overlap=True`` the CPU side steps an offloaded chunk
        as soon as the step's last backward pass has handed over its gradients (or, clipping,
        speculatively: Note [speculative step]), before ``step()``; the chunk's moments and
        its parameters (a streamed weight's host copy) are then updated while the step counts,
        the GPU side and the other chunks are not. A ``state_dict()`` taken there mixes two
        steps (a checkpoint that resumes differently from torch's, whose state between
        ``backward()`` and ``step()`` is the one before the step), and a ``load_state_dict()``
        would be overwritten in part by the step, so both are refused until ``step()`` (with
        ``param_sync="forward"`` completed, as they do themselves) has taken them. Before the
        step's last backward pass (between micro-batches, during a forward) nothing is handed
        over and the state is the one before the step: exact.

        Raises:
            RuntimeError: with ``what``, chunks of the coming step are with the worker.
        """
        with self.lock:
            stepped = len(self.queued)
        if what is not None and stepped:
            raise RuntimeError(
                f"{what} between backward() and step(): {stepped} offloaded chunks of this "
                f"step were already stepped during the backward (overlap=True), so the state "
                f"is half updated (Note [state between steps]); call it after step() or "
                f"before the step's last backward")
        with self.idle:
            while self.outstanding:
                self.idle.wait()  # state must not change while it is read or written
