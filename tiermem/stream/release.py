"""When a streamed block's weights may leave the device in a depth-first backward (Note
[backward release]).

Note [backward release]: in the backward of a depth-first pass (Note [weight streaming] in
tiermem/stream/weights.py) a streamed block is filled before any of its backward nodes runs
and must stay on the device until the last node that reads one of its weights has run. Two
events bound those nodes:

- **A trainable weight's accumulation.** Every backward node that reads a weight ``W`` (the
  weight itself, layer_norm's save, or a view of it, ``F.linear``'s ``W.t()``) belongs to an op
  that had ``W`` (or the view's op, which has an edge to ``W``) as an input; when ``W`` requires
  grad that node feeds ``W``'s AccumulateGrad, so the post-accumulate-grad hook of ``W`` runs
  after all of ``W``'s readers. This holds only for the weights whose AccumulateGrad this
  backward executes: the *expected* ones, asked of the engine when the backward reaches the
  block (``torch._C._will_engine_execute_node`` on the weight's gradient edge). A trainable
  weight that gets no gradient this time (an MoE expert that received no token, or an
  ``autograd.grad`` call that does not ask for weights) never reports.
- **The block's inputs' gradients.** A hook on each tensor input of the block that requires
  grad (registered by the forward pre-hook) fires when that input's gradient is complete, i.e.
  after every node on every path from the block's outputs to it. A node that reads a weight
  combines it with an activation computed from the inputs (a linear, a norm, an expert) and
  computes that activation's gradient, so it is on such a path: frozen weights (LoRA's base)
  and weights without a gradient this time are covered. FSDP2 frees a module's unsharded
  parameters on the same event (its post-backward runs on the gradients of the module's
  inputs). A node that reads a weight combined only with other parameters (a parameter-only
  subgraph, e.g. ``scale = self.a @ self.b`` before it meets the activations) is not on such a
  path; it runs before the input's hook by the engine's order (a ready node created later in
  the forward runs first, and AccumulateGrad first of all), which is the assumption here.

The rule: a block is released when all its expected weights have accumulated and, unless every
streamed weight of the block is expected (a fully trainable dense block: the first event is
enough, as before), the gradients of all its inputs that require grad have been computed. A
block with such weights and no input requiring grad (block 0 after frozen embeddings) stays on
the device until the backward ends, when the stream's end-of-backward callback frees whatever
is left; so does a block one of whose inputs gets no gradient (an input the output does not
depend on). Before this rule a block was released once all its trainable weights had
accumulated: a block with a frozen weight was freed before that weight's readers ran (a
LayerNorm read an empty placeholder), and a block with a frozen base only, or an MoE block
with an idle expert, stayed on the device until the backward ended, all of them at once
(tests/stream/test_compose.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tiermem.stream.blocks import Block, Param


def _will_execute(p: Param) -> bool:
    """Whether the running backward executes ``p``'s AccumulateGrad (it gets a gradient)."""
    node = torch.autograd.graph.get_gradient_edge(p.param).node
    return bool(torch._C._will_engine_execute_node(node))


class BackwardRelease:
    """One pass's bookkeeping of Note [backward release]: the inputs of each block whose
    gradients are pending, the weights expected to accumulate, those that have.

    Raises:
        nothing at construction.
    """

    def __init__(self) -> None:
        self._inputs: dict[int, int] = {}       # block -> inputs requiring grad (forward)
        self._pending: dict[int, int] = {}      # block -> of those, gradients not yet computed
        self._expected: dict[int, set[int]] = {}     # block -> id(param) expected to accumulate
        self._accumulated: dict[int, set[int]] = {}  # block -> id(param) accumulated

    def watch_inputs(self, block: Block, inputs: Any, on_grad: Callable[[int], None]) -> None:
        """Hook every tensor in ``inputs`` (the forward's args and kwargs) that requires grad;
        ``on_grad(block.index)`` runs when each one's gradient is computed.

        Raises:
            nothing beyond torch's errors.
        """
        # a Parameter passed in lives on: a hook per pass on it would pile up (the block then
        # waits for the end of the backward when it has frozen weights and no other input)
        ts = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad
              and not isinstance(t, nn.Parameter)]
        i = block.index
        self._inputs[i] = self._pending[i] = len(ts)
        for t in ts:
            t.register_hook(lambda g, i=i: on_grad(i))

    def reached(self, block: Block) -> None:
        """The backward reached ``block`` (its weights are ready): note which of its trainable
        weights this backward will accumulate. Once per block and backward.

        Raises:
            nothing beyond torch's errors.
        """
        if block.index not in self._expected:
            self._expected[block.index] = {id(p.param) for p in block.params
                                           if p.trainable and _will_execute(p)}
            self._accumulated[block.index] = set()

    def accumulated(self, p: Param) -> bool:
        """``p``'s gradient has accumulated; True when its block may be released now."""
        done = self._accumulated.setdefault(p.block.index, set())
        done.add(id(p.param))
        return self.may_release(p.block)

    def input_grad(self, block: Block) -> bool:
        """One input of ``block`` has its gradient; True when the block may be released now."""
        i = block.index
        if self._pending.get(i, 0) > 0:
            self._pending[i] -= 1
        return self.may_release(block)

    def may_release(self, block: Block) -> bool:
        """Whether no backward node left can read ``block``'s weights (Note [backward
        release])."""
        i = block.index
        expected = self._expected.get(i)
        if expected is None or not expected <= self._accumulated.get(i, set()):
            return False
        if len(expected) == len(block.params):
            return True  # every streamed weight reported after its readers
        return self._inputs.get(i, 0) > 0 and self._pending[i] == 0

