"""CUDA graph capture: what tiermem refuses while a stream is being captured, and why.

Note [cuda graphs]: a CUDA graph replays the kernels and copies recorded during capture and
nothing else: no Python runs on replay. Activation offload moves saved tensors in Python pack
and unpack hooks (store puts, events, prefetch), so a captured forward or backward would replay
stale copies into freed buffers; HybridAdam hands each gradient to its CPU side in a Python
post-accumulate-grad hook and steps on the CPU, and with ``param_sync="forward"`` waits for
each module's updated params in a forward pre-hook, none of which a replay repeats. All are
refused with ``RuntimeError`` the moment they would run inside a capture
(:func:`refuse_capture`; tests/optim/test_hybrid_adam_graphs.py). What works: ``torch.cuda.make_graphed_callables`` on a module whose
params HybridAdam steps. Its captured backward computes the param gradients with
``torch.autograd.grad`` (no accumulation inside the graph); autograd accumulates them into
``p.grad`` eagerly after each replay, so HybridAdam's hooks run as without graphs. They run in
another order, though: the graphed backward is one autograd node that returns every gradient at
once (an MLP's arrive as params 0, 2, 1, 3, against 3, 2, 1, 0 eager), so with
``placement="trace"`` (Note [trace placement] in tiermem/optim/state_setup.py) the GPU/CPU split
of the state differs from an eager run's, and with it which elements torch's fused Adam (GPU)
and tiermem's CPU kernel step; the two round differently in the last bit, so graphed and eager
runs agree to rounding, not bit for bit. ``placement="given"`` gives both the same split, and
then the same bits (tests/optim/test_hybrid_adam_graphs.py). Activation
offload of a graphed module is refused: its saved tensors live in the graph's private memory
pool, which offload cannot touch (checkpointing, which frees them, cannot be captured either).
"""

from __future__ import annotations

import torch


def capturing(t: torch.Tensor | None = None) -> bool:
    """Whether the current CUDA stream is capturing a graph (False on the CPU and for
    ``t`` not on a CUDA device)."""
    if t is not None and not t.is_cuda:
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_capture(who: str, what: str, fix: str, t: torch.Tensor | None = None) -> None:
    """Raise when called inside a CUDA graph capture (Note [cuda graphs]).

    Args:
        who: the caller named in the message, e.g. ``"HybridAdam"``.
        what: what was about to run, e.g. ``"a gradient hook"``.
        fix: what to do instead.
        t: a tensor whose device decides (a CPU tensor never refuses); ``None``: the current
            CUDA stream decides.

    Raises:
        RuntimeError: the current CUDA stream is capturing a graph.
    """
    if capturing(t):
        raise RuntimeError(f"{who}: {what} ran inside a CUDA graph capture (torch.cuda.graph or "
                           f"make_graphed_callables); a replay runs no Python, so it would be "
                           f"skipped or repeat stale copies (Note [cuda graphs] in "
                           f"tiermem/_graphs.py); fix: {fix}")
