"""What the CPU side of a ``param_sync="forward"`` step read of the gradients after ``step()``
returned, checked against the gradients as ``step()`` left them (Note [gradient writes after a
forward-synced step]).

Note [gradient writes after a forward-synced step]: with ``param_sync="forward"``, ``step()``
returns while the worker still reads offloaded gradients (a chunk's D2H copy on the copy
stream, waiting only for the gradient's own event from backward; a streamed weight's host
gradient read in place by the CPU kernel; a GPU-lane chunk's copy on the lane stream). An
in-place write to ``p.grad`` before the next forward -- ``model.zero_grad(set_to_none=False)``
(torch's ``nn.Module`` method, not the optimizer's), ``p.grad.zero_()``, ``p.grad.mul_(...)``,
a write through ``p.grad.data`` -- is queued on the caller's stream (on the CPU: runs on the
caller's thread) with nothing ordering it after those reads: the worker could step chunks from
the zeroed or changed values, a silent wrong result (8 steps on the CPU differed from
torch.optim.AdamW from the second step on). ``HybridAdam.zero_grad(set_to_none=False)``
completes the step first and ``set_to_none=True`` only drops ``p.grad`` (the worker holds its
own reference): both are exact. The write itself cannot be made to wait (nothing in torch
calls the optimizer before it), and the gradients cannot be taken out of ``p.grad`` at
``step()`` (a loop may read them after ``step()``: a grad-norm log; torch's optimizers leave
them) or copied aside (a second copy of every gradient still to be read, in GPU memory). So it
is detected, exactly, from the bytes: :meth:`ReadGuard.watch`, at the end of such a
``step()``, takes the checksum (``tiermem.stream.checksums.checksum``, on the caller's stream:
ahead of any later write there) of each piece of each chunk not stepped yet -- the bytes the
worker must read -- and, for reads issued before that and not yet finished, a sum on the
reading stream behind them; every read issued after it is followed by a sum of the same piece
on its own stream (:meth:`ReadGuard.read`; on the CPU at once). A read that saw a written byte
is followed by a sum that sees it too (the sum reads it later; only a second write that puts
the bytes back, or changes whose words cancel as Note [streamed weight checksums] lists, can
hide it), so a piece whose last sum equals its mark was read as ``step()`` left it, and a
write after the reads (the loop logs, then zeroes in place) passes: bit for bit the same step.
:meth:`ReadGuard.verdict` compares them when the step completes (``finish_step``: the next
forward, ``synchronize()``, the next backward or ``step()``, ``state_dict()``), on the copy
stream (behind the marks' event, not behind the forward queued since; one host wait for that
stream), and the completion then raises one line naming a param, the cause, that the step may
be wrong (restart from a checkpoint) and the fixes, with the step counted and the optimizer
usable. Conservative in one window: a write landing between a read and its sum is refused
though the read preceded it. Cost, ``param_sync="forward"`` only: one read of each gradient
piece not yet stepped when ``step()`` returns (on the caller's stream; a streamed weight's
host gradient on the caller's thread, after its D2H has landed) and one more after each later
read, a sum kernel per piece, and at the completion one host wait on the copy stream;
nothing with ``param_sync="step"`` (``step()`` waits for every read).
tests/optim/test_forward_sync_grad_writes.py (+ ``_cuda``).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any

import torch

from tiermem.stream.checksums import checksum

Key = tuple  # (group, chunk, local tensor)


class ReadGuard:
    """Note [gradient writes after a forward-synced step]: the marks and sums of one step
    (held by ``StepState.reads``; the worker, the lane and the caller's thread share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enabled = False  # set once by HybridAdam: param_sync="forward" (else nothing kept)
        self.reset()

    def reset(self) -> None:
        """Forget the step (caller's thread, the worker idle).

        Raises:
            Nothing.
        """
        with self._lock:
            self._watching = False
            self._in_flight: list[tuple] = []  # (g, c, pieces, stream, event) issued before
            self._after: dict[Key, tuple] = {}  # key -> (sum, event or None): the last read's
            self._marks: dict[Key, torch.Tensor] = {}  # key -> the sum step() left
            self._marks_event: Any = None

    def read(self, g: int, c: int, pieces: list[tuple[int, torch.Tensor]],
             stream: Any) -> None:
        """Chunk ``c`` of group ``g`` has just read ``pieces`` (``(local tensor, the flat
        gradient's piece)``): on ``stream`` (a CUDA stream, the reads issued there) or, with
        None, completely (worker or lane). Before :meth:`watch` only a CUDA read's event is
        kept; after it, each piece is summed behind the read.

        Raises:
            Nothing beyond torch's errors.
        """
        if not pieces or not self.enabled:
            return
        with self._lock:
            if self._watching:
                self._sum_after(g, c, pieces, stream)
            elif stream is not None:
                event = torch.cuda.Event()
                event.record(stream)  # the reads are issued: watch() asks if they finished
                self._in_flight.append((g, c, pieces, stream, event))

    def _sum_after(self, g: int, c: int, pieces: list[tuple[int, torch.Tensor]],
                   stream: Any) -> None:
        """Sum ``pieces`` on ``stream`` (None: now), behind the read; under the lock, so the
        last sum kept for a piece is the last one issued."""
        if stream is not None and any(t.device.type == "cpu" for _, t in pieces):
            stream.synchronize()  # a host piece read by a copy on the stream: sum it after
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            sums = [(param, checksum(t)) for param, t in pieces]
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)  # verdict() reads the sums behind this
                for _, t in pieces:
                    t.record_stream(stream)  # the gradient is read here until the sum ends
        for param, total in sums:
            self._after[(g, c, param)] = (total, event)

    def watch(self, step: Any, groups: list, consumer: Any) -> None:
        """At the end of a ``param_sync="forward"`` ``step()`` (caller's thread): mark the
        pieces of every chunk of ``step`` (the StepState) not stepped yet, as ``step()`` left
        them, on ``consumer`` (the caller's CUDA stream, None on the CPU), and sum behind the
        CUDA reads still running; from now on every read is summed behind.

        Raises:
            Nothing beyond torch's errors.
        """
        running = set()
        with self._lock:
            self._watching = True
            in_flight, self._in_flight = self._in_flight, []
            for g, c, pieces, stream, event in in_flight:
                if not event.query():  # may still read when the loop writes p.grad
                    self._sum_after(g, c, pieces, stream)
                    running.add((g, c))  # a lane chunk is "issued" with its reads running
        with step.lock:
            pending = [item for item in step.chunk_missing if item not in step.chunk_h2d]
            refs = dict(step.grad_refs)
        marks = {}
        for g, c in dict.fromkeys(pending + sorted(running)):
            for pc in groups[g].plan.chunks[c].pieces:
                ref = refs.get((g, pc.param))
                if ref is None:
                    continue
                grad, ready = ref
                if grad.device.type == "cpu" and ready is not None:
                    ready.synchronize()  # a streamed host gradient: its D2H has landed
                marks[(g, c, pc.param)] = checksum(grad[pc.start:pc.start + pc.numel])
        event = None
        if consumer is not None and marks:
            event = torch.cuda.Event()
            event.record(consumer)  # verdict() compares behind the marks
        with self._lock:
            self._marks, self._marks_event = marks, event

    def verdict(self, side: Any) -> list[Key]:
        """When the step completes (caller's thread, every chunk done): the pieces whose last
        sum differs from their mark, compared on ``side`` (a CUDA stream, None on the CPU).

        Raises:
            Nothing beyond torch's errors.
        """
        with self._lock:
            keys = [k for k in self._marks if k in self._after]
            if not keys:
                return []
            marks = [self._marks[k] for k in keys]
            after = [self._after[k] for k in keys]
            marks_event = self._marks_event
        with torch.cuda.stream(side) if side is not None else nullcontext():
            if side is not None:
                if marks_event is not None:
                    side.wait_event(marks_event)  # the marks are on the caller's stream
                for ev in dict.fromkeys(ev for _, ev in after if ev is not None):
                    side.wait_event(ev)  # the sums behind the reads
            by_device: dict[torch.device, tuple[list, list, list]] = {}
            for key, mark, (total, _) in zip(keys, marks, after):
                ks, then, now = by_device.setdefault(mark.device, ([], [], []))
                ks.append(key)
                then.append(mark)
                now.append(total.to(mark.device))
            changed = []
            for ks, then, now in by_device.values():
                differ = (torch.stack(then) != torch.stack(now)).tolist()  # the one host wait
                changed += [k for k, d in zip(ks, differ) if d]
        return sorted(changed)


def refuse_written_grads(who: str, changed: list[Key]) -> None:
    """Raise for :meth:`ReadGuard.verdict`'s ``changed`` pieces (Note [gradient writes after a
    forward-synced step]); the step is complete when this is called.

    Raises:
        RuntimeError: ``changed`` is not empty.
    """
    if not changed:
        return
    g, _, i = changed[0]
    params = len({(k[0], k[2]) for k in changed})
    raise RuntimeError(
        f"{who}: the gradient of param {i} of param group {g} (of {params} params) was written "
        f"in place after step() returned (param_sync='forward') before the CPU side had read "
        f"it, e.g. by model.zero_grad(set_to_none=False), p.grad.zero_() or p.grad.mul_(): "
        f"that step may have used the written values for some offloaded chunks, so restart "
        f"from a checkpoint; zero gradients with model.zero_grad() (set_to_none=True, "
        f"torch's default) or opt.zero_grad(), or call opt.synchronize() before writing "
        f"p.grad in place")
