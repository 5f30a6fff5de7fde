"""A weight stream's block-major pass: each block runs for every micro-batch of an optimizer
step while its weights are on the device, once in the forward and once in the backward
(Note [block-major passes]).

Note [block-major passes]: :func:`tiermem.schedule.block_major.block_major_forward_backward`
(Note [block-major schedule]) runs a step's M micro-batches block by block. A phase-1 pass
(Note [weight streaming] in tiermem/stream/weights.py) refuses that pattern, because a block
called M times in a row, or a forward begun while the previous graph is alive, is a misuse there.
So the schedule opens the pass explicitly, ``with stream.block_major(M):``, and inside it the
stream expects exactly this sequence of block calls and refuses any other (the call changes
nothing and the pass goes on where it was):

- **forward phase**, under ``torch.no_grad()``: block 0 for micro-batches 0..M-1, block 1 for
  0..M-1, ..., the last block for 0..M-1. A streamed block is filled before its first call
  (prefetched ``prefetch_blocks`` blocks ahead, as in phase 1) and released after its M-th,
  but the last ones (``plan.kept``), which stay on the device for the backward phase (Note
  [kept into backward] in tiermem/stream/residency.py). After the last block, the first
  blocks of the backward that are not on the device are prefetched while the head runs.
- **backward phase**, with autograd on: the last block for 0..M-1, ..., block 0 for 0..M-1.
  Each call is the schedule's recomputation from the block's saved input, and the schedule
  back-propagates it (``torch.autograd.backward(y, grad_y)``) before the next call. The block
  is made ready before its first call and stays on the device until the first call of the block
  before it (or the end of the pass): one fill per pass for all M backward passes. A hook on the
  recomputation's outputs refuses a backward that reaches a block after the pass moved on (its
  weights were released). A recomputation *inside* the backward (a block checkpointed as a
  whole) is told from a call by ``torch._C._current_graph_task_id() != -1``, as in phase 1, and
  accepted for the block on the device only.

Gradients. A trainable weight whose host gradient was None when the pass began keeps its
gradient on the device for the whole of its block's M backward passes: autograd itself
accumulates it there (``grad = g0``, then ``grad += g1``, ...), exactly as without streaming.
It is taken to the host once, when the block is released (Note [host gradients]): one copy per
block per step instead of M. A weight that already had a host gradient (accumulation across
several passes before an optimizer step) is taken after each micro-batch's backward and added
on the host, in micro-batch order: the adds the same loop makes without streaming. Either way
the gradient is the same bits as depth-first's.

Fills per optimizer step: 2 per streamed block (forward, backward; 1 for a kept one), whatever
M; phase 1's depth-first loop makes 2 * M (M). A call that fails (a fill, the block's own
forward) marks the pass failed: later calls are refused and leaving the context ends the pass
(blocks released, host copies restored, the stream usable; the pass's gradients are
incomplete). Leaving the
context without an error before the sequence is complete raises (the gradients would be
incomplete) after ending the pass the same way. ``optimizer.step()`` over streamed weights
inside the context is refused (the weights are not on the host).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tiermem.names import check_int


def _in_backward() -> bool:
    """Whether the calling thread runs inside an autograd backward (a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class BlockMajorPass:
    """One optimizer step's block-major pass of a :class:`tiermem.stream.WeightStream` over
    ``n_micro`` micro-batches (Note [block-major passes]); a context manager made by
    :meth:`WeightStream.block_major`.

    Raises:
        ValueError, TypeError: ``n_micro`` not an int >= 1.
    """

    def __init__(self, stream: Any, n_micro: int) -> None:
        check_int("WeightStream.block_major: ", "n_micro", n_micro, unit="micro-batches",
                  fix="give the optimizer step's number of micro-batches")
        self._stream = stream
        self.n_micro = n_micro
        self.phase = "new"          # "new", "forward", "backward", "done", "ended"
        self.block = 0              # the block whose call comes next
        self.micro = 0              # the micro-batch of that call
        self.held: int | None = None  # the backward phase's block on the device
        self.failed = False
        self._running: int | None = None
        self._host_acc: set[int] = set()  # id(param) of weights with a host gradient at start

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "BlockMajorPass":
        s = self._stream
        if self.phase != "new":
            raise RuntimeError("WeightStream.block_major(): this pass was entered already; "
                               "make a new one per optimizer step")
        if s.closed:
            raise RuntimeError("WeightStream.block_major(): the stream is closed")
        s._settle_idle_pass()
        if s._pass is not None:
            raise RuntimeError("WeightStream.block_major(): a forward/backward pass is open "
                               "(its graph is alive); run its backward or drop its outputs "
                               "first")
        s._begin_pass()
        s._take_grads()  # its backward phase comes: Note [gradients at backward]
        s._major = self
        self._host_acc = {id(p.param) for b in s._blocks for p in b.params
                          if p.acc is not None}
        self.phase = "forward"
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        s = self._stream
        if s._major is not self:  # ended already (close(force=True))
            self.phase = "ended"
            return
        complete = self.phase == "done" and not self.failed
        where = self._where()
        try:
            if complete:
                self._land(self.held)
        finally:
            s._end_pass()
            self.phase = "ended"
        if exc_type is None and not complete:
            raise RuntimeError(
                f"weight streaming: a block-major pass over {self.n_micro} micro-batches was "
                f"left before its sequence ended ({where}); its gradients are incomplete: "
                f"zero them (optimizer.zero_grad()) before the next pass")

    # ------------------------------------------------------------------ hooks

    def pre_forward(self, i: int) -> None:
        """The forward pre-hook of block ``i`` during this pass.

        Raises:
            RuntimeError: a call out of the pass's sequence (Note [block-major passes]), the
                errors of a fill (then the pass is failed).
        """
        s = self._stream
        if _in_backward():  # a block checkpointed as a whole, recomputed by autograd
            if self.phase in ("backward", "done") and self.held == i:
                return
            raise RuntimeError(
                f"weight streaming: blocks[{i}] recomputed inside a backward of a block-major "
                f"pass while blocks[{self.held}] is the block on the device; back-propagate "
                f"each block's recomputation before the pass moves on")
        self._check_call(i)
        block = s._blocks[i]
        try:
            if self.micro == 0:
                n = len(s._blocks)
                if self.phase == "forward":
                    if block.streamed:
                        s._fetcher.ready(block)
                    s._prefetch([j for j in range(i + 1, n) if s._blocks[j].streamed])
                else:
                    if self.held is not None:
                        self._land(self.held)
                    self.held = i
                    if block.streamed:
                        s._fetcher.ready(block)
                    s._prefetch([j for j in range(i - 1, -1, -1) if s._blocks[j].streamed])
        except BaseException:
            self.failed = True
            raise
        self._running = i

    def post_forward(self, i: int, out: Any) -> None:
        """The forward hook of block ``i`` during this pass (advances the sequence).

        Raises:
            the errors of a release or a prefetch (then the pass is failed).
        """
        if _in_backward() or self._running != i:
            return
        self._running = None
        if out is None and sys.exc_info()[0] is not None:  # the block's forward raised
            self.failed = True
            return
        s = self._stream
        if self.phase == "backward":
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, i=i: self._check_backward(i))
        self.micro += 1
        if self.micro < self.n_micro:
            return
        self.micro = 0
        try:
            if self.phase == "forward":
                if s._blocks[i].streamed and i not in s.plan.kept:  # Note [kept into backward]
                    s._fetcher.release(s._blocks[i])
                self.block += 1
                if self.block == len(s._blocks):  # the backward's first blocks, during the head
                    self.phase, self.block = "backward", len(s._blocks) - 1
                    s._prefetch([j for j in reversed(range(len(s._blocks)))
                                 if s._blocks[j].streamed])
            else:
                self.block -= 1
                if self.block < 0:
                    self.phase = "done"
        except BaseException:
            self.failed = True
            raise

    def after_accumulate(self, p: Any) -> None:
        """The post-accumulate-grad hook of the streamed weight ``p`` during this pass.

        Raises:
            the errors of the host gradient's copy (then the pass is failed).
        """
        if self.phase not in ("backward", "done") or id(p.param) not in self._host_acc:
            return  # autograd accumulates it on the device; taken when the block is released
        try:
            grad = p.param.grad
            p.param.grad = None
            self._stream._grads.take(p, grad)
        except BaseException:
            self.failed = True
            raise

    # ------------------------------------------------------------------ helpers

    def _check_call(self, i: int) -> None:
        if self.failed:
            raise RuntimeError(f"weight streaming: blocks[{i}] called after a failed call of "
                               f"this block-major pass; leave the block_major() context")
        if self.phase not in ("forward", "backward"):
            raise RuntimeError(f"weight streaming: blocks[{i}] called after the block-major "
                               f"pass's backward phase ended; leave the block_major() context "
                               f"and begin a new pass")
        if self._running is not None:
            raise RuntimeError(f"weight streaming: blocks[{i}] called inside the forward of "
                               f"blocks[{self._running}]; streamed blocks do not nest")
        if i != self.block:
            order = "first to last" if self.phase == "forward" else "last to first"
            raise RuntimeError(
                f"weight streaming: blocks[{i}] called out of order in the {self.phase} phase "
                f"of a block-major pass over {self.n_micro} micro-batches: blocks[{self.block}] "
                f"runs next (micro-batch {self.micro}); each block runs for every micro-batch "
                f"in turn, {order} (Note [block-major passes])")
        grad = torch.is_grad_enabled()
        if self.phase == "forward" and grad:
            raise RuntimeError(f"weight streaming: blocks[{i}] called with autograd on in the "
                               f"forward phase of a block-major pass; that phase runs under "
                               f"torch.no_grad() (the backward phase recomputes each block)")
        if self.phase == "backward" and not grad:
            raise RuntimeError(f"weight streaming: blocks[{i}] called under torch.no_grad() in "
                               f"the backward phase of a block-major pass; the backward phase "
                               f"recomputes each block with autograd on and back-propagates it")

    def _check_backward(self, i: int) -> None:
        if self._stream._major is not self or self.held != i:
            raise RuntimeError(
                f"weight streaming: a backward reached blocks[{i}] of a block-major pass after "
                f"the pass moved on (its weights were released); back-propagate each "
                f"recomputation before recomputing the next block")

    def _land(self, i: int | None) -> None:
        """Take block ``i``'s device-accumulated gradients to the host and release it."""
        if i is None:
            return
        s = self._stream
        block = s._blocks[i]
        for p in block.params:
            grad = p.param.grad
            if grad is not None:
                p.param.grad = None
                s._grads.take(p, grad, passes=self.n_micro)  # autograd summed n_micro
        if block.streamed:
            s._fetcher.release(block)

    def _where(self) -> str:
        if self.phase in ("forward", "backward"):
            return (f"{self.phase} phase, blocks[{self.block}] micro-batch {self.micro} "
                    f"next" + (", after a failed call" if self.failed else ""))
        return self.phase + (", after a failed call" if self.failed else "")
