"""Where the stream's forward hooks run: inside a backward (a checkpoint's recomputation), and
whether a block's forward the pass records as running can still return (Note [interrupted
forward]).

Note [interrupted forward]: the stream learns that a block's forward has ended from its forward
hook, registered with ``always_call=True`` so that a forward which raises ends the pass (Note
[weight streaming] in tiermem/stream/weights.py). torch calls such hooks only for an
``Exception``: a ``BaseException`` that is not one (``KeyboardInterrupt``, ``SystemExit``, a
training loop's own interrupt class thrown by a hook or a signal handler) leaves the block's
forward without the hook, and the pass recorded that block as running (``current``) for good.
Every later forward was refused ("called again while the previous forward's pass is open"),
and so were ``close()``, ``model.state_dict()`` and the optimizer's step: a loop that caught
the interrupt (to save a checkpoint, or to skip a batch) could not continue without
``close(force=True)``. So each block's pre-hook records the running call: its thread and the
frame of the block's ``Module.__call__`` (``running_call``; dropped when the forward hook runs).
An open pass is ended where an idle pass is (``_settle_idle_pass``: the next forward's first
block, a state dict, an optimizer step, ``close()``) once that call cannot return: asked on its
thread, and its frame is not on that thread's stack (a frame object, held, is never reused, so
a new call of the same block from the same line is not taken for it; a ``state_dict()`` or a
``blocks[0]`` called from inside the running forward still finds it there, and is refused as
before). Nothing of the interrupted forward is kept: the blocks it filled are released and the
host copies and gradients are the parameters' again, as after a forward that raised an
``Exception``; a graph of its earlier blocks that a traceback still holds is a graph of an
ended pass, whose backward is refused. The held frame keeps the interrupted call's locals (one
block's input) until then. Asked from another thread the pass stays open (that thread may still
be running the block). tests/stream/test_stream_corners.py.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

import torch
from torch import nn

# the frames of a module call: a block's forward is running while one of them is on the stack
_CALL_CODES = (nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__)


def in_backward() -> bool:
    """Whether the calling thread runs inside an autograd backward (checkpoint recompute).

    Raises:
        nothing.
    """
    return torch._C._current_graph_task_id() != -1


def running_call(module: nn.Module) -> tuple[int, FrameType] | None:
    """``(thread id, frame)`` of the innermost call of ``module`` on the calling thread's
    stack (its ``Module.__call__``, from inside one of its forward hooks), or None.

    Raises:
        nothing.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES and frame.f_locals.get("self") is module:
            return threading.get_ident(), frame
        frame = frame.f_back
    return None


def forward_died(call: tuple[int, FrameType] | None) -> bool:
    """Whether the block call ``call`` (from :func:`running_call`), which a pass records as
    running, will never reach its forward hook (Note [interrupted forward]): asked on its
    thread, and its frame is not on that thread's stack. False for None or another thread.

    Raises:
        nothing.
    """
    if call is None or call[0] != threading.get_ident():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame is call[1]:
            return False  # still running: asked from inside that block's forward
        frame = frame.f_back
    return True
