"""Gradients of streamed weights leave the device as they are produced and accumulate on the
host (Note [host gradients]).

Note [host gradients]: a post-accumulate-grad hook runs once per backward for each streamed
parameter, right after autograd has put the backward's gradient into ``param.grad`` (on the
device). The hook takes that tensor out (``param.grad = None``, so no gradient of the whole
model ever sits on the device) and accumulates it into the parameter's host gradient: the
first backward since the gradient was cleared copies it, each later one adds it in place, in
the parameter's dtype, in backward order. That is exactly what autograd does to ``param.grad``
without streaming (``grad = new`` then ``grad += new``: the same elementwise IEEE adds in the
same dtype and order), so accumulation over micro-batches is bit-identical. On CUDA the copy
runs on the D2H stream into pinned memory (the first one straight into the host gradient,
later ones into a per-parameter pinned staging tensor), and the adds run on the host when the
pass ends (with HybridAdam connected, as soon as the copies have landed:
Note [streamed gradient hand-off]), in the order the copies were issued (or, when a pass takes
one parameter's gradient again before it ends, before its staging tensor is reused). On the CPU
the gradient autograd made is kept as the host gradient (no copy) and later ones are added at
once.

Note [streamed gradient hand-off]: ``HostGrads.take`` is the one place a streamed weight's
gradient lands on the host, so it is also where an optimizer that steps the host copies
(HybridAdam, tiermem/optim/streamed.py) is told about it: a ``sink(entry, passes, event)`` set
by :meth:`tiermem.stream.WeightStream.connect` is called once the host gradient ``entry.acc``
holds, or is being written with, every backward pass taken so far (``passes``: how many
backward passes this take covers, ``n_micro`` for a block-major pass's device-accumulated
gradient, else 1), in the order the gradients were taken (backward order). ``event`` is None
when ``entry.acc`` is complete, else the CUDA event of the D2H copy still writing it: the sink
(HybridAdam's chunk worker: ``host_grads_landed`` in tiermem/optim/chunk_worker.py) waits on it
before it reads the host gradient. On the CPU every take hands over at once with no event. On
CUDA (Note [hand-off lag]) a take whose copy goes straight into the host gradient (the first
of the step, or a block-major pass's one) hands it over at once with that copy's event; a
later micro-batch's copy goes into a staging tensor whose add on the host must come first, so
it is handed over once that copy has landed and been added: by a later take that sees it
finished (``event.query()``, no wait) or by :meth:`flush` at the end of the pass. A parameter
waiting for its add holds back the ones taken after it (the order).

Note [hand-off lag]: the sink once learned of every CUDA gradient only when the autograd
thread polled (a later take) after its D2H copy had landed, or at :meth:`HostGrads.flush` when
the pass ended. Nothing in a streamed pass blocks the host, so it runs ahead of the GPU: the
copies of the last gradients a backward produced had not landed at any later take and reached
the sink only at the end of the pass, and HybridAdam stepped their chunks after the backward
instead of during it (session 13's streamed HybridAdam row spent 481 ms after its backward
against the resident row's 264). Now a gradient copied straight into its host gradient is
handed over at once with its D2H event, like HybridAdam's own hook hands over an event for a
device gradient, and the worker thread waits for the GPU instead of the autograd thread
polling (Note [streamed gradient hand-off]). Only a staged later micro-batch (gradient
accumulation over depth-first passes) still waits for a poll or the pass end. ``stats()`` of
the stream counts both (``handed_in_pass``, ``handed_at_end``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiermem.stream.copies import StreamCopies
from tiermem.stream.grad_norms import GradNorms


@dataclass(eq=False)
class _Pending:
    entry: Any            # the parameter's _Param (tiermem.stream.blocks)
    staging: torch.Tensor | None  # None: the copy went straight into entry.acc
    event: Any


class HostGrads:
    """Accumulates streamed parameters' gradients on the host (Note [host gradients]).

    Args:
        copies: the stream's copies.
        pin: allocate host gradients and staging tensors in pinned memory (CUDA).
    """

    def __init__(self, copies: StreamCopies, pin: bool) -> None:
        self.copies = copies
        self.pin = pin
        self._pending: list[_Pending] = []
        self._staged: set[int] = set()  # id(entry) whose staging tensor a pending copy fills
        # Note [streamed gradient hand-off]: callable(entry, passes, event)
        self.sink: Any = None
        # (entry, passes, the D2H event of a copy straight into entry.acc or None), not yet
        # handed to the sink
        self._told: list[tuple[Any, int, Any]] = []
        # Note [hand-off lag]: gradients handed to the sink during the pass / by flush()
        self.handed = {"handed_in_pass": 0, "handed_at_end": 0}
        # Note [streamed gradient norms]: norms of whole gradients, taken as they leave
        self.norms = GradNorms()

    def take(self, entry: Any, grad: torch.Tensor, passes: int = 1) -> None:
        """Accumulate the device gradient ``grad`` of ``entry`` (whose ``acc`` is its host
        gradient or None) into ``entry.acc``; hand it to the sink, at once with the event of
        its copy straight into ``entry.acc``, or once a staged copy has landed and been added
        (Note [streamed gradient hand-off]). ``passes``: backward passes ``grad`` holds. A
        gradient that is the whole of ``entry.acc`` has its norm taken on the device when
        ``norms.want`` says it completes the step (Note [streamed gradient norms]).

        Raises:
            RuntimeError: torch's copy or add errors; the sink's errors.
        """
        if not self.copies.cuda:
            if entry.acc is None:
                entry.acc = grad  # autograd's own tensor: nothing else refers to it now
                self.norms.record(grad, self.norms.measure(grad, passes))
            else:
                self.norms.forget(entry.acc)  # Note [streamed gradient norms]
                entry.acc.add_(grad)
            if self.sink is not None:
                self.handed["handed_in_pass"] += 1
                self.sink(entry, passes, None)
            return
        straight = None  # the event of a copy straight into entry.acc
        if entry.acc is None:
            entry.acc = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            straight = self.copies.grad_out(entry.acc, grad)
            # beside the copy, on the caller's stream: Note [streamed gradient norms]
            self.norms.record(entry.acc, self.norms.measure(grad, passes))
            self._pending.append(_Pending(entry, None, straight))
        else:
            self.norms.forget(entry.acc)
            if entry.staging is None:
                entry.staging = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            elif id(entry) in self._staged:
                self._land(entry)  # the staging tensor is reused: add what it holds first
            self._pending.append(_Pending(entry, entry.staging,
                                          self.copies.grad_out(entry.staging, grad)))
            self._staged.add(id(entry))
        if self.sink is not None:
            self._told.append((entry, passes, straight))
            self._land_finished()

    def _land_finished(self) -> None:
        """Land the copies that have finished, in issue order, without waiting, and hand the
        sink every parameter with no staged add left to do (Note [streamed gradient
        hand-off])."""
        while self._pending and self.copies.finished(self._pending[0].event):
            item = self._pending.pop(0)
            if item.staging is not None:
                item.entry.acc.add_(item.staging)
                if not any(q.entry is item.entry for q in self._pending):
                    self._staged.discard(id(item.entry))
        self._tell()

    def _tell(self, when: str = "handed_in_pass") -> None:
        """Hand the sink, in take order, each told parameter with no staged copy in flight,
        with the event of its copy straight into ``entry.acc`` while that is in flight."""
        busy = {id(item.entry) for item in self._pending if item.staging is not None}
        while self._told and id(self._told[0][0]) not in busy:  # the order: none passes a busy one
            entry, passes, event = self._told.pop(0)  # first: a sink that raises is told once
            self.handed[when] += 1
            landed = event is None or self.copies.finished(event)
            self.sink(entry, passes, None if landed else event)

    def _land(self, entry: Any) -> None:
        """Wait for ``entry``'s gradient copies in flight and add them, in issue order (a
        second take of one parameter in a pass: block-major, Note [block-major passes])."""
        keep = []
        for item in self._pending:
            if item.entry is not entry:
                keep.append(item)
                continue
            self.copies.landed(item.event)  # the host adds (or reuses) the copied bytes next
            if item.staging is not None:
                item.entry.acc.add_(item.staging)
        self._pending = keep
        self._staged.discard(id(entry))

    def flush(self) -> None:
        """Wait for the gradient copies in flight and add them, in the order they were issued.

        Raises:
            RuntimeError: torch's add errors.
        """
        pending, self._pending = self._pending, []
        self._staged.clear()
        for item in pending:
            self.copies.landed(item.event)
            if item.staging is not None:
                item.entry.acc.add_(item.staging)
        if self._told:
            self._tell("handed_at_end")
