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
later ones into a per-parameter pinned staging tensor). The adds run on the stream's gradient
adder thread (Note [gradient adder] in tiermem/stream/grad_adds.py), never on the autograd
thread: each waits for its copy to land, in the order the copies were issued; a second take of
one parameter in a pass waits for that parameter's previous add before its copy reuses the
staging tensor, and :meth:`HostGrads.flush` at the pass end waits for all of them. On the CPU
the gradient autograd made is kept as the host gradient (no copy), and later ones are
enqueued as they are and added by the same thread.

Note [gradients at backward]: the host gradient is taken aside (``entry.acc``, ``.grad``
None) when the pass's backward begins (its first pre-backward hook, ``_take_grads``; a
block-major pass at its start), not when its forward begins. A pass whose forward recorded a
graph stays open until its backward, or, when its outputs are dropped without one (a
validation loss computed with autograd on), until the next forward, state dict, optimizer
step or ``close()`` settles it. The gradients used to go aside at the forward, so in that
window every streamed ``.grad`` read None: ``clip_grad_norm_`` after such an evaluation left
the streamed gradients out of the norm and unclipped, and the step took them whole; a
``zero_grad()`` there was undone when the pass ended, and the next step's gradients were
added to the last step's. So was a ``zero_grad()`` between a training forward and its
backward (PyTorch's quickstart loop: ``loss = model(x)``, ``zero_grad()``, ``backward()``):
the backward added to the gradients taken aside at the forward. All three were silent. Now a forward leaves ``.grad`` as it is, the
pass end puts back only what its backward took, and a gradient set during the forward is
checked when the backward takes it (``check_host_grads``). ``.data`` of a released block is
still the empty placeholder in that window (docs/streaming.md).
tests/stream/test_stream_corners.py.

Note [streamed gradient hand-off]: ``HostGrads.take`` is the one place a streamed weight's
gradient lands on the host, so it is also where an optimizer that steps the host copies
(HybridAdam, tiermem/optim/streamed.py) is told about it: a ``sink(entry, passes, event)`` set
by :meth:`tiermem.stream.WeightStream.connect` is called once the host gradient ``entry.acc``
holds, or is being written with, every backward pass taken so far (``passes``: how many
backward passes this take covers, ``n_micro`` for a block-major pass's device-accumulated
gradient, else 1), in the order the gradients were taken (backward order). ``event`` is None
when ``entry.acc`` is complete, else the CUDA event of the D2H copy still writing it: the sink
(HybridAdam's chunk worker: ``host_grads_landed`` in tiermem/optim/chunk_worker.py) waits on it
before it reads the host gradient. A take copied straight into its host gradient (the first
of the step, or a block-major pass's one; on the CPU: kept as it is) is handed over at once on
the caller's thread, with that copy's event, when no earlier take's add is still queued; a
later micro-batch's take is handed over by the gradient adder thread right after its add
(Note [gradient adder]), and so is a straight take enqueued behind one: one queue of adds and
hand-offs in take order, so none passes a busy one. A hand-off made while :meth:`flush` waits
counts as made at the pass end.

Note [hand-off lag]: the sink once learned of every CUDA gradient only when the autograd
thread polled (a later take) after its D2H copy had landed, or at :meth:`HostGrads.flush` when
the pass ended. Nothing in a streamed pass blocks the host, so it runs ahead of the GPU: the
copies of the last gradients a backward produced had not landed at any later take and reached
the sink only at the end of the pass, and HybridAdam stepped their chunks after the backward
instead of during it (session 13's streamed HybridAdam row spent 481 ms after its backward
against the resident row's 264). Now a gradient copied straight into its host gradient is
handed over at once with its D2H event, like HybridAdam's own hook hands over an event for a
device gradient, and the worker thread waits for the GPU instead of the autograd thread
polling (Note [streamed gradient hand-off]). A staged later micro-batch (gradient accumulation
over depth-first passes) is handed over by the adder thread as soon as it is added, not at a
poll (Note [gradient adder]); only those whose adds are still queued when the backward ends
are handed over at the end. ``stats()`` of the stream counts them (``handed_in_pass``,
``handed_at_end``) and the adds (``adds_off_thread``, ``add_waits``).

Note [last pass sums on the device]: with gradient accumulation over depth-first passes the
host adds of the step's last pass are on the step's critical path: a parameter is handed to
HybridAdam only after its add, and in that pass the adds compete with HybridAdam's CPU step
for the host's cores and memory. On the H200 the 64k-token bench's last pass took 581 ms
against 262-268 ms for the others (``end_wait_s`` 0.48 s: the adder added 11.1 GB/s;
docs/results/bench_stream_64k_passes_s16.log). So in the pass whose take completes a parameter's
step (the connected optimizer says so: ``completes(entry)`` returns the backward passes the
sum will then hold, HybridAdam's count + 1 when it reaches ``grad_accumulation_steps``), the
stream uploads the host gradient ``acc`` to the device beside the block's backward fill
(:meth:`HostGrads.upload`, on the H2D stream, for the blocks whose backward fill is issued),
the take adds the new gradient to it there (``dev.add_(grad)``: ``acc + grad``, the add
autograd makes, in the same dtype; a bf16 add is the fp32 sum rounded to nearest even on either
device, so the sum is bit-identical to the host add's) and copies the sum straight into
``acc``, handed over at once with the copy's event like a first take, with its norm taken on
the device (Note [streamed gradient norms]): no host add is left in that pass. The cost: the
sums' bytes once more over PCIe (H2D) in the last pass, and up to ``prefetch_blocks + 2``
blocks of sums on the device during that backward (counted by ``tiermem plan``). A sum
uploaded but never taken (the pass failed, or the parameter had no gradient) is dropped at the
pass end; ``acc`` is unchanged then. Without a connected optimizer, or in a pass that does not
complete the step, the adder thread adds as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tiermem.stream.copies import StreamCopies
from tiermem.stream.grad_adds import AddItem, GradAdder
from tiermem.stream.grad_norms import GradNorms


class HostGrads:
    """Accumulates streamed parameters' gradients on the host (Note [host gradients]).

    Args:
        copies: the stream's copies.
        pin: allocate host gradients and staging tensors in pinned memory (CUDA).

    Attributes:
        stage_on_cpu: tests: on the CPU copy a later micro-batch's gradient into the staging
            tensor first, as CUDA does (the staging reuse rule runs: Note [gradient adder]).
    """

    stage_on_cpu = False

    def __init__(self, copies: StreamCopies, pin: bool) -> None:
        self.copies = copies
        self.pin = pin
        # gradients handed to the sink during the pass / by flush() (Note [hand-off lag])
        self.handed = {"handed_in_pass": 0, "handed_at_end": 0}
        # takes summed on the device (Note [last pass sums on the device])
        self.sums = {"device_sums": 0}
        self._adder = GradAdder(copies, self.handed)  # Note [gradient adder]
        weakref.finalize(self, self._adder.stop)
        self._straight: list[Any] = []  # D2H events of copies straight into a host gradient
        # completes(entry): the passes a take would complete the step with, else None (Note
        # [last pass sums on the device]); set by the connected optimizer
        self.completes: Any = None
        self._uploaded: list[Any] = []  # entries whose dev_sum is on the device this pass
        # norms of whole gradients, taken as they leave (Note [streamed gradient norms])
        self.norms = GradNorms()

    @property
    def sink(self) -> Any:
        """``sink(entry, passes, event)`` or None (Note [streamed gradient hand-off]); set by
        the connected optimizer.

        Raises:
            nothing.
        """
        return self._adder.sink

    @sink.setter
    def sink(self, sink: Any) -> None:
        self._adder.sink = sink

    def stats(self) -> dict:
        """The hand-off counts (Note [hand-off lag]), the adder's (``adds_off_thread``,
        ``add_waits``: Note [gradient adder]) and ``device_sums`` (Note [last pass sums on the
        device]), since the stream began.

        Raises:
            nothing.
        """
        return dict(self.handed, **self._adder.counts, **self.sums)

    def take(self, entry: Any, grad: torch.Tensor, passes: int = 1) -> None:
        """Accumulate the device gradient ``grad`` of ``entry`` (whose ``acc`` is its host
        gradient or None) into ``entry.acc``: copied straight in (and handed to the sink at
        once with the copy's event, when no add is queued before it), or staged and enqueued
        for the adder thread, which adds it and then hands it over (Note [streamed gradient
        hand-off], Note [gradient adder]). ``passes``: backward passes ``grad`` holds. A
        gradient that is the whole of ``entry.acc`` has its norm taken on the device when
        ``norms.want`` says it completes the step (Note [streamed gradient norms]).

        Raises:
            RuntimeError: an add or hand-off that failed on the adder thread since the last
                take (naming its parameter); torch's copy errors; the sink's errors.
        """
        self._adder.raise_failed()
        tell = self.sink is not None
        if entry.dev_sum is not None:  # Note [last pass sums on the device]
            self._sum_on_device(entry, grad, tell)
            return
        if entry.acc is None:
            if self.copies.cuda:
                entry.acc = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
                event = self.copies.grad_out(entry.acc, grad)
                self._straight.append(event)
                # beside the copy, on the caller's stream: Note [streamed gradient norms]
                self.norms.record(entry.acc, self.norms.measure(grad, passes))
            else:
                entry.acc = grad  # autograd's own tensor: nothing else refers to it now
                event = None
                self.norms.record(grad, self.norms.measure(grad, passes))
            if tell:
                self._hand_straight(entry, event, passes)
            return
        self.norms.forget(entry.acc)  # Note [streamed gradient norms]
        if self.copies.cuda or self.stage_on_cpu:
            if entry.staging is None:
                entry.staging = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self.pin)
            else:
                self._adder.wait_for(entry)  # the staging tensor is reused: its add first
            staged, event = entry.staging, self.copies.grad_out(entry.staging, grad)
        else:
            staged, event = grad, None
        self._adder.put(AddItem(entry, entry.acc, staged, event, passes, tell=tell))

    def upload(self, entries: list[Any]) -> None:
        """Start copying the host gradient of each of ``entries`` whose next take completes
        its step to the device (Note [last pass sums on the device]); nothing without a
        connected optimizer that says so.

        Raises:
            RuntimeError: torch's allocation and copy errors (nothing is uploaded then).
        """
        completes = self.completes
        if completes is None:
            return
        todo = []
        for e in entries:
            if e.acc is None or e.dev_sum is not None or not e.trainable:
                continue
            passes = completes(e)
            if passes is not None:
                todo.append((e, passes))
        if not todo:
            return
        sums = [torch.empty(e.acc.shape, dtype=e.acc.dtype, device=self.copies.device)
                for e, _ in todo]
        event = self.copies.fill([(dev, e.acc) for dev, (e, _) in zip(sums, todo)])
        for dev, (e, passes) in zip(sums, todo):
            if self.copies.cuda:  # the allocator keeps dev until the upload wrote it, even
                dev.record_stream(self.copies.h2d_stream)  # if the pass drops it unread
            e.dev_sum, e.dev_event, e.dev_passes = dev, event, passes
            self._uploaded.append(e)

    def _sum_on_device(self, entry: Any, grad: torch.Tensor, tell: bool) -> None:
        """The step's last take of ``entry``: add ``grad`` to its uploaded sum on the device,
        copy the sum straight into ``entry.acc`` and hand it over with the copy's event (Note
        [last pass sums on the device])."""
        dev = entry.dev_sum
        entry.dev_sum = None
        self.copies.use(entry.dev_event)  # the add reads the sum this upload writes
        entry.dev_event = None
        with torch.no_grad():
            dev.add_(grad)  # acc + grad: autograd's accumulation, in the same dtype
        self.norms.forget(entry.acc)
        event = self.copies.grad_out(entry.acc, dev)
        self._straight.append(event)
        self.sums["device_sums"] += 1
        # beside the copy, on the caller's stream: Note [streamed gradient norms]
        self.norms.record(entry.acc, self.norms.measure(dev, entry.dev_passes))
        if tell:
            self._hand_straight(entry, event, 1)

    def _hand_straight(self, entry: Any, event: Any, passes: int) -> None:
        """Hand over a gradient copied straight into ``entry.acc`` (its copy's ``event``): at
        once when no earlier take is still being added, else behind them (Note [streamed
        gradient hand-off])."""
        item = AddItem(entry, entry.acc, None, event, passes, tell=True)
        if self._adder.idle():  # nothing taken before it is still being added
            self._adder.hand(item)
        else:
            self._adder.put(item)

    def flush(self) -> None:
        """Wait until every gradient copy and add of the pass is done and every hand-off made
        (the adder thread then ends, Note [gradient adder]). An error of the adder thread is
        kept for :meth:`raise_failed` (the pass end raises it once the stream is restored).

        Raises:
            RuntimeError: the adder thread ended with adds not done (a bug).
        """
        self._adder.drain()
        for e in self._uploaded:  # taken, or dropped unread: acc unchanged
            e.dev_sum = e.dev_event = None
        self._uploaded = []
        straight, self._straight = self._straight, []
        for event in straight:
            self.copies.landed(event)  # the next pass and step() read what this copy writes

    def raise_failed(self) -> None:
        """Raise, once, an add or hand-off that failed on the adder thread (Note [gradient
        adder]).

        Raises:
            RuntimeError: naming the parameter; the stream stays usable.
        """
        self._adder.raise_failed()
