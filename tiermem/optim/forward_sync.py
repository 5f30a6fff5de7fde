"""``param_sync="forward"``: the next forward waits, module by module, for the offloaded
chunks of the params that module uses (Note [forward sync]).

Note [forward sync]: after such a ``step()``, a global forward pre-hook makes each module wait
(host: until the worker has stepped the chunks holding its params and issued their H2D;
stream: on those copies' events) before it runs. Everything else that reads the params or the
state completes the step first: the next ``step()``, the next backward's first gradient hook,
``state_dict``/``load_state_dict`` (the optimizer's; the model's modules' by
Note [model state dicts after a forward-synced step]), ``synchronize()``, ``close`` and
``zero_grad(set_to_none=False)`` (which overwrites gradients the CPU side may not have copied
yet). Code that reads a
param outside a module's forward (an EMA, logging a norm) must call ``opt.synchronize()``
first. A gradient written in place before the CPU side read it (``model.zero_grad(
set_to_none=False)``, ``p.grad.zero_()``: torch's, not the optimizer's) is refused when the
step completes, and one written after every read passes: Note [gradient writes after a
forward-synced step] in grad_reads.py; ``opt.synchronize()`` first makes any write safe.
One process only (data parallel all-gathers the updated shards in ``step()``; FSDP2 gathers
params in its own pre-forward hooks).

Note [model state dicts after a forward-synced step]: ``torch.save(model.state_dict())``
right after ``step()`` is how loops checkpoint, and with ``param_sync="forward"`` the worker was
still writing offloaded params then: a probe saved 1-3 of 16 tensors from the step before (and
``model.load_state_dict`` there was overwritten by the write-back, or refused by Note [param
changes] at the completion). The optimizer sees no model, only params, so :class:`ModelHooks`
registers a ``state_dict`` and a ``load_state_dict`` pre-hook on every module whose own params
it steps, as the global forward pre-hook first meets the module (every module a forward runs,
before the first ``step()``; a compiled module's submodules at once): each completes a pending
step first. Reads of params outside ``state_dict`` (an EMA) still need ``opt.synchronize()``.
tests/optim/test_forward_sync_state_dict.py.

Note [completion in inference mode]: the forward that completes a step is often an evaluation
under ``torch.inference_mode()`` (``model.eval()`` after ``step()``), and completing it starts
the next step on the caller's thread (``_begin_step``), which allocates what that step keeps:
the speculation's rollback slots at the first step with state (Note [speculative step]), store
blocks for the first chunks' read-ahead. Made there they were inference tensors, and the
worker's first in-place copy into one outside inference mode failed the next step ("the CPU
step failed: Inplace update to inference tensor"; ``param_sync="forward"`` with clipping and
``rollback_bytes``, with or without a weight stream). ``_begin_step`` therefore runs with
inference mode off, under ``no_grad`` (it records no graph). Store slabs are made outside it
anyway (Note [slabs outside inference mode] in tiermem/store/pool.py).
tests/stream/test_stream_corners.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from tiermem.optim.step_state import StepState


def wait_for_module(step: StepState, chunks_of: dict[int, Any], module: torch.nn.Module,
                    consumer: Any) -> bool:
    """Wait until the worker has stepped and copied back the chunks of ``module``'s params,
    and make ``consumer`` (the caller's CUDA stream, ``None`` on CPU) wait on those copies;
    ``chunks_of`` maps ``id(param)`` to its chunks. Returns True when every chunk of the step
    is done (or failed): the caller then completes the whole step instead.

    Raises:
        Nothing.
    """
    # a compiled module runs its submodules inside one graph, without their hooks: wait
    # here for every parameter under it (the whole model for torch.compile(model))
    params = module.parameters() if _compiled(module) else module._parameters.values()
    chunks = [item for p in params if p is not None for item in chunks_of.get(id(p), ())]
    if not chunks:
        return False
    with step.idle:
        while any(item not in step.chunk_h2d for item in chunks) and not step.errors:
            step.idle.wait()  # the worker has not stepped this module's chunks yet
        events = [step.chunk_h2d.get(item) for item in chunks]
        done = len(step.chunk_h2d) == len(step.chunk_missing) or bool(step.errors)
    if done:
        return True
    for event in events if consumer is not None else ():
        if event is not None:
            consumer.wait_event(event)  # this module reads the params copied H2D
    return False


def _compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs its submodules inside one compiled graph, without their hooks."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or getattr(
        module, "_compiled_call_impl", None) is not None


def _complete(ref: weakref.ref, *_: Any) -> None:
    """A model state-dict pre-hook: complete the optimizer's pending step, if it still exists
    (Note [model state dicts after a forward-synced step])."""
    opt = ref()
    if opt is not None and opt._pending:
        opt.synchronize()


class ModelHooks:
    """Note [model state dicts after a forward-synced step]: the ``state_dict`` and
    ``load_state_dict`` pre-hooks of the modules holding the optimizer's offloaded params.

    Args:
        ref: a weak reference to the optimizer (Note [lifetime]: hooks never keep it alive).
        param_ids: ``id()`` of every param whose chunks the worker writes.
        handles: the optimizer's hook handles (removed by ``close()`` and its finalizer); the
            new ones are appended to it.
    """

    def __init__(self, ref: weakref.ref, param_ids: set[int], handles: list) -> None:
        self._ref, self._ids, self._handles = ref, param_ids, handles
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def see(self, module: torch.nn.Module) -> None:
        """Hook ``module`` (all of its submodules when compiled) once, if it holds any of the
        params (the global forward pre-hook, caller's thread).

        Raises:
            Nothing.
        """
        if module in self._seen:
            return
        self._seen.add(module)
        hook = functools.partial(_complete, self._ref)
        for m in (module.modules() if _compiled(module) else (module,)):
            if any(p is not None and id(p) in self._ids for p in m._parameters.values()):
                self._handles.append(m.register_state_dict_pre_hook(hook))
                self._handles.append(m.register_load_state_dict_pre_hook(hook))
