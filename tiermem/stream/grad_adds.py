"""The host adds of streamed gradients, run in take order on a thread of the stream's own
(Note [gradient adder]).

Note [gradient adder]: a later micro-batch's gradient of a streamed weight is added into its
host gradient on the host (Note [host gradients] in tiermem/stream/grads.py): 2.3 GB of bf16
per pass for the 24-block reference GPT, which on the autograd thread (the thread that launches
the backward's kernels) took ~380 ms of a 64k-token step in which the GPU starved
(docs/results/bench_stream_64k_depth-first_s15.log). So :class:`GradAdder` runs them on one
thread per stream. ``HostGrads.take`` (on the autograd thread) only issues the copy and
enqueues an :class:`AddItem`; the adder thread takes the items one at a time in the order they
were enqueued (the take order), waits for the item's D2H copy to land (CUDA; ``copies.landed``
on the event), adds the staged gradient into ``entry.acc`` with :func:`add_into` (the same
``acc.add_(grad)`` as before: the same elementwise adds in the same dtype, and per parameter in
the same order, so the sums are bit-identical), and then hands the parameter to the sink
(Note [streamed gradient hand-off]) when the take asked for it. One FIFO for adds and hand-offs
keeps the order rule: a hand-off never passes an earlier take whose add is not done. A take
copied straight into an empty host gradient (nothing to add) is handed over on the caller's
thread at once when the queue is empty, else enqueued behind the busy ones (the adder then
hands it with its copy's event while that is in flight). The rules around it:

- staging reuse: a second take of one parameter in a pass (block-major accumulation on the
  host) waits on the caller's thread until that parameter's previous add is done before its
  copy overwrites the staging tensor (``wait_for``; counted as ``add_waits``);
- ``HostGrads.flush`` (the pass end) waits until every item is done, then the thread ends
  (a new one starts with the next pass's first item): the next pass, ``step()`` and a norm
  taken in ``step()`` (Note [streamed gradient norms]) see whole gradients only;
- an add or a hand-off that raises on the adder thread is kept (the first one of a pass, with
  the parameter's name) and raised on the caller's thread by ``raise_failed`` at the next take
  or at the pass end (after ``flush``, once the stream's state is restored); that parameter is
  handed over no more in the pass; the rest of the queue still runs, and the stream stays
  usable; the pass's gradients are incomplete (zero them);
- the GIL: torch releases it inside ``add_`` and ``Event.synchronize``, so the autograd thread
  runs Python while the adder adds (checked on torch 2.13 CPU: the main thread ran ~280k loop
  iterations during 0.2 s of bf16 adds on another thread);
- intra-op threads: the adds use torch's default (``torch.get_num_threads()``). torch has no
  per-thread setting: ``torch.set_num_threads`` on the adder thread also sets the count every
  thread that starts intra-op work later gets (checked on torch 2.13). The adds compete with
  HybridAdam's CPU step (``cpu_threads``) only in the last micro-batch's pass, and there every
  add is on that step's critical path (a parameter is handed over only after its add), so they
  are not slowed down to leave cores to it.

On the CPU (no copies) the later micro-batches' gradients autograd made are enqueued as they
are (no staging tensor, nothing to wait for), so the same thread, order and hand-off rules run
in the CPU tests; ``HostGrads.stage_on_cpu`` (tests) copies them into the staging tensor first,
as CUDA does, so that the staging reuse rule runs there too.

Note [adder seconds]: the adder's time, in ``counts`` (seconds since the stream began; a
bench takes differences per step): ``adder_busy_s`` the adder thread's work (adds and
hand-offs), ``adder_copy_wait_s`` its waits for D2H copies to land, ``added_bytes`` the bytes
it added; ``add_wait_s`` the caller's (autograd thread's) waits for the adder, of which
``end_wait_s`` at pass ends (``drain``: the GPU has no queued work then, so each such second
is a second the GPU idles before the next pass; ``tiermem bench stream`` prints them).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

_STOP = object()
"""Tells the adder thread to end (the pass is flushed)."""


def add_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """``acc += grad`` in place: the elementwise add autograd makes when it accumulates
    ``param.grad`` (Note [host gradients]); on the adder thread (Note [gradient adder]).

    Raises:
        RuntimeError: torch's add errors.
    """
    acc.add_(grad)


def entry_key(entry: Any) -> str:
    """``blocks[i].name`` of a streamed parameter's entry (its repr when it has neither).

    Raises:
        nothing.
    """
    block = getattr(entry, "block", None)
    name = getattr(entry, "name", None)
    if name is None:
        return repr(entry)
    return f"blocks[{block.index}].{name}" if block is not None else str(name)


@dataclass(eq=False)
class AddItem:
    """One take for the adder thread (Note [gradient adder])."""

    entry: Any                    # the parameter's _Param (tiermem.stream.blocks)
    acc: torch.Tensor             # entry.acc at the take: the host gradient to add into
    staging: torch.Tensor | None  # the gradient to add into entry.acc (None: hand-off only)
    event: Any                    # the D2H copy writing staging / entry.acc (None: landed)
    passes: int                   # backward passes the take covers
    tell: bool                    # hand entry to the sink once added
    done: bool = False


class GradAdder:
    """The ordered queue of host adds and hand-offs and its thread (Note [gradient adder]).

    Args:
        copies: the stream's copies (``landed``/``finished`` on the D2H events).
        handed: the hand-off counts to add to (``handed_in_pass``/``handed_at_end``).

    Attributes:
        sink: ``sink(entry, passes, event)`` (Note [streamed gradient hand-off]) or None.
        counts: ``adds_off_thread`` (adds the thread made) and ``add_waits`` (takes that
            waited for their parameter's previous add: staging reuse); seconds and bytes
            (Note [adder seconds]).
    """

    def __init__(self, copies: Any, handed: dict) -> None:
        self.copies = copies
        self.handed = handed
        self.sink: Callable[[Any, int, Any], None] | None = None
        self.counts: dict[str, float] = {
            "adds_off_thread": 0, "add_waits": 0, "added_bytes": 0,  # Note [adder seconds]
            "adder_busy_s": 0.0, "adder_copy_wait_s": 0.0, "add_wait_s": 0.0,
            "end_wait_s": 0.0}
        self._cond = threading.Condition()
        self._queue: deque = deque()      # AddItems not done (the first is being worked on)
        self._last: dict[int, AddItem] = {}  # id(entry) -> its last staged item of the pass
        self._failed: set[int] = set()    # id(entry) whose add or hand-off failed this pass
        self._error: tuple[Any, str, BaseException] | None = None
        self._thread: threading.Thread | None = None
        self._flushing = False

    def idle(self) -> bool:
        """Whether no item is queued or being worked on.

        Raises:
            nothing.
        """
        with self._cond:
            return not self._queue

    def put(self, item: AddItem) -> None:
        """Enqueue ``item`` (the caller's thread), starting the thread if none runs.

        Raises:
            RuntimeError: the thread cannot be started.
        """
        with self._cond:
            self._queue.append(item)
            if item.staging is not None:
                self._last[id(item.entry)] = item
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="tiermem-grad-adder")
                self._thread.start()

    def wait_for(self, entry: Any) -> bool:
        """Wait until ``entry``'s last staged item is done (its staging tensor is reused next);
        return whether there was one to wait for.

        Raises:
            RuntimeError: the adder thread ended with the item not done (a bug).
        """
        with self._cond:
            item = self._last.get(id(entry))
            if item is None or item.done:
                return False
            self.counts["add_waits"] += 1
            t0 = time.perf_counter()
            while not item.done:
                self._check_alive()
                self._cond.wait(1.0)  # the next copy overwrites the staging this add reads
            self.counts["add_wait_s"] += time.perf_counter() - t0  # Note [adder seconds]
        return True

    def hand(self, item: AddItem) -> None:
        """Hand ``item``'s parameter to the sink (once added), with its copy's event while
        that is in flight; counted as handed during the pass or at its end.

        Raises:
            the sink's errors.
        """
        sink = self.sink
        if sink is None or not item.tell:
            return
        with self._cond:
            self.handed["handed_at_end" if self._flushing else "handed_in_pass"] += 1
        landed = item.staging is not None or self.copies.finished(item.event)
        sink(item.entry, item.passes, None if landed else item.event)

    def drain(self) -> None:
        """Wait until every item is done, then end the thread (the pass end: Note [gradient
        adder]). Keeps an error for :meth:`raise_failed`.

        Raises:
            RuntimeError: the adder thread ended with items not done (a bug).
        """
        with self._cond:
            self._flushing = True
            t0 = time.perf_counter()
            self._wait_idle()
            waited = time.perf_counter() - t0  # Note [adder seconds]
            self.counts["add_wait_s"] += waited
            self.counts["end_wait_s"] += waited
            thread, self._thread = self._thread, None
            self._last.clear()
            self._failed.clear()
            self._flushing = False
            if thread is not None:
                self._queue.append(_STOP)
                self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # the thread ends with the pass: none is left between passes

    def wait_idle(self) -> None:
        """Wait until every item enqueued so far is done; the thread goes on (tests).

        Raises:
            RuntimeError: the adder thread ended with items not done (a bug).
        """
        with self._cond:
            self._wait_idle()

    def _wait_idle(self) -> None:
        while self._queue:
            self._check_alive()
            self._cond.wait(1.0)  # the next pass and step() read only whole gradients

    def stop(self) -> None:
        """End the thread without waiting for the queue (the stream was collected).

        Raises:
            nothing.
        """
        with self._cond:
            if self._thread is not None:
                self._queue.append(_STOP)
                self._thread = None
                self._cond.notify_all()

    def raise_failed(self) -> None:
        """Raise the kept error of the adder thread (once), naming the parameter.

        Raises:
            RuntimeError: an add or a hand-off on the adder thread failed.
        """
        with self._cond:
            error, self._error = self._error, None
        if error is None:
            return
        entry, what, exc = error
        raise RuntimeError(
            f"weight streaming: {what} of {entry_key(entry)} failed on the gradient adder "
            f"thread: {type(exc).__name__}: {exc}; this pass's streamed gradients are "
            f"incomplete: zero them (optimizer.zero_grad()) before the next step") from exc

    # ------------------------------------------------------------------ the thread

    def _check_alive(self) -> None:
        thread = self._thread
        if self._queue and (thread is None or not thread.is_alive()):
            raise RuntimeError("weight streaming: the gradient adder thread ended with "
                               f"{len(self._queue)} host adds not done")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()  # the autograd thread enqueues the next take
                item = self._queue[0]
                if item is _STOP:
                    self._queue.popleft()
                    return
            self._work(item)
            with self._cond:
                self._queue.popleft()
                item.done = True
                item.staging = None  # on the CPU autograd's gradient: freed once added
                self._cond.notify_all()

    def _work(self, item: AddItem) -> None:
        key = id(item.entry)
        what = "the host add of a micro-batch's gradient"
        t0 = time.perf_counter()
        landed = t0  # Note [adder seconds]: busy from the copy's landing on
        try:
            if item.staging is not None:
                self.copies.landed(item.event)  # the add reads the bytes this copy writes
                landed = time.perf_counter()
                add_into(item.acc, item.staging)
                with self._cond:
                    self.counts["adds_off_thread"] += 1
                    self.counts["added_bytes"] += item.staging.numel() * \
                        item.staging.element_size()
            what = "the hand-off to the optimizer"
            if key not in self._failed:  # else its gradient is incomplete: never handed
                self.hand(item)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            with self._cond:
                self._failed.add(key)
                if self._error is None:
                    self._error = (item.entry, what, exc)
        done = time.perf_counter()
        with self._cond:
            self.counts["adder_copy_wait_s"] += landed - t0
            self.counts["adder_busy_s"] += done - landed
