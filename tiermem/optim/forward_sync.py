"""``param_sync="forward"``: the next forward waits, module by module, for the offloaded
chunks of the params that module uses (Note [forward sync]).

Note [forward sync]: after such a ``step()``, a global forward pre-hook makes each module wait
(host: until the worker has stepped the chunks holding its params and issued their H2D;
stream: on those copies' events) before it runs. Everything else that reads the params or the
state completes the step first: the next ``step()``, the next backward's first gradient hook,
``state_dict``/``load_state_dict``, ``synchronize()``, ``close`` and ``zero_grad(set_to_none=
False)`` (which overwrites gradients the CPU side may not have copied yet). Code that reads a
param outside a module's forward (an EMA, logging a norm) or writes a gradient in place
(``model.zero_grad(set_to_none=False)``) must call ``opt.synchronize()`` first.
One process only (data parallel all-gathers the updated shards in ``step()``; FSDP2 gathers
params in its own pre-forward hooks).
"""

from __future__ import annotations

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
    compiled = isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or getattr(
        module, "_compiled_call_impl", None) is not None
    params = module.parameters() if compiled else module._parameters.values()
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
