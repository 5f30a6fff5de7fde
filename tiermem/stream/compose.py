"""How a weight stream meets ``torch.compile`` (Note [compiled blocks]); the other
compositions are checked in tiermem/stream/checks.py (``check_composition``) and documented
in docs/streaming.md.

Note [compiled blocks]: a block compiled in place (``block.compile()``) compiles its
``_call_impl``, hooks included, so dynamo would trace the stream's forward hooks: Python state
changes (the pass, the fills), ``UntypedStorage.resize_`` and ``Tensor.set_``, which it cannot
put in a graph. It breaks the graph around them and guards the resumed frames on the block
index, so every block recompiles the same code until dynamo's recompile limit sends the rest
to eager. The stream's module hooks are therefore ``torch.compiler.disable``'d: dynamo calls
them eagerly and traces only the block's own forward, one graph for all blocks of a shape
(their weights are graph inputs, ``inline_inbuilt_nn_modules``), whose guards see the full
weights because the pre-hook has filled the block before the forward runs. A block wrapped by
``torch.compile(block)`` (an ``OptimizedModule`` put into ``model.blocks``) runs its hooks
eagerly anyway. A compiled forward saves the weights it reads for its backward as the stream
expects (the parameters, or views of their storages: Note [weight streaming]), and the
backward hooks (tensor and post-accumulate-grad hooks) run in the eager autograd engine. Tested
on the CPU with the ``aot_eager`` and ``inductor`` backends, compiled before and after
streaming (tests/stream/test_compose_compile.py). Not covered: CUDA graphs
(``mode="reduce-overhead"``), which record the weights' device addresses, while each fill
allocates a block's storages anew; compiled autograd; a compiled region spanning several
streamed blocks (``torch.compile(model)``: the blocks' hooks are then traced inside one
frame).
"""

from __future__ import annotations

from typing import Callable

import torch


def eager(fn: Callable) -> Callable:
    """``fn`` as a hook dynamo never traces (Note [compiled blocks]).

    Raises:
        nothing.
    """
    return torch.compiler.disable(fn, recursive=True)
