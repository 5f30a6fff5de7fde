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
(HybridAdam, tiermem/optim/streamed.py) is told about it: a ``sink(entry, passes)`` set by
:meth:`tiermem.stream.WeightStream.connect` is called once the host gradient ``entry.acc``
holds every backward pass taken so far (``passes``: how many backward passes this take covers,
``n_micro`` for a block-major pass's device-accumulated gradient, else 1), in the order the
gradients were taken (backward order). On the CPU that is at once. On CUDA a gradient is
complete only when its D2H copy (and the add of a staged later micro-batch) has landed: each
take lands, in issue order, the copies already finished (``event.query()``, no wait) and hands
over every parameter with nothing left in flight; the rest are handed over by :meth:`flush`
at the end of the pass. The sink never sees a gradient still being written.

Note [hand-off lag]: on CUDA the sink learns of a gradient only when the autograd thread polls
(a later take) after its D2H copy has landed, or at :meth:`HostGrads.flush` when the pass ends.
Nothing in a streamed pass blocks the host, so it runs ahead of the GPU by as many kernels as
CUDA lets it queue: the copies of the last gradients a backward produces (perhaps most of
them) have not landed at any later take and reach the sink only at the end of the pass, and
HybridAdam then steps their chunks after the backward instead of during it. HybridAdam's own
gradient hook hands over an event instead (its worker thread waits for the GPU). ``stats()``
of the stream counts both (``handed_in_pass``, ``handed_at_end``). Session 13's streamed
HybridAdam row spent 481 ms after its backward against the resident row's 264: this lag if
most gradients are handed at the end (measured by scripts/device_run.sh's stage
``bench_stream_diag``, not yet run). The fix then: hand a gradient copied straight into its
host gradient over at once with its D2H event and make HybridAdam's worker wait for that
event before it reads a host gradient (``_copy_grads`` in tiermem/optim/chunk_worker.py); a
staged later micro-batch's add must still land first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tiermem.stream.copies import StreamCopies


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
        self.sink: Any = None  # Note [streamed gradient hand-off]: callable(entry, passes)
        self._told: list[tuple[Any, int]] = []  # (entry, passes) not yet handed to the sink
        # Note [hand-off lag]: gradients handed to the sink during the pass / by flush()
        self.handed = {"handed_in_pass": 0, "handed_at_end": 0}

    def take(self, entry: Any, grad: torch.Tensor, passes: int = 1) -> None:
        """Accumulate the device gradient ``grad`` of ``entry`` (whose ``acc`` is its host
        gradient or None) into ``entry.acc``; hand it to the sink once it has landed (Note
        [streamed gradient hand-off]). ``passes``: backward passes ``grad`` holds.

        Raises:
            RuntimeError: torch's copy or add errors; the sink's errors.
        """
        if not self.copies.cuda:
            if entry.acc is None:
                entry.acc = grad  # autograd's own tensor: nothing else refers to it now
            else:
                entry.acc.add_(grad)
            if self.sink is not None:
                self.handed["handed_in_pass"] += 1
                self.sink(entry, passes)
            return
        if entry.acc is None:
            entry.acc = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            self._pending.append(_Pending(entry, None, self.copies.grad_out(entry.acc, grad)))
        else:
            if entry.staging is None:
                entry.staging = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            elif id(entry) in self._staged:
                self._land(entry)  # the staging tensor is reused: add what it holds first
            self._pending.append(_Pending(entry, entry.staging,
                                          self.copies.grad_out(entry.staging, grad)))
            self._staged.add(id(entry))
        if self.sink is not None:
            self._told.append((entry, passes))
            self._land_finished()

    def _land_finished(self) -> None:
        """Land the copies that have finished, in issue order, without waiting, and hand the
        sink every parameter with no copy left in flight (Note [streamed gradient hand-off])."""
        while self._pending and self.copies.finished(self._pending[0].event):
            item = self._pending.pop(0)
            if item.staging is not None:
                item.entry.acc.add_(item.staging)
                if not any(q.entry is item.entry for q in self._pending):
                    self._staged.discard(id(item.entry))
        self._tell()

    def _tell(self, when: str = "handed_in_pass") -> None:
        """Hand the sink, in take order, each told parameter whose copies have all landed."""
        busy = {id(item.entry) for item in self._pending}
        while self._told and id(self._told[0][0]) not in busy:  # the order: none passes a busy one
            entry, passes = self._told.pop(0)  # taken first: a sink that raises is not told twice
            self.handed[when] += 1
            self.sink(entry, passes)

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
