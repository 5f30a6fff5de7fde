"""HybridAdam's modes: what differs between one process, data parallel (ZeRO) and FSDP2.

HybridAdam picks one :class:`Mode` at construction (:func:`choose_mode`) and asks it, never
the mode's name, for everything that differs: which tensors this rank steps (the params, their
FSDP2 local shards, or its ZeRO shard's pieces of them), which gradient hooks feed the CPU side
and how gradients are reduced, how the global norm for clipping is reduced, how the updated
params reach every rank, and how ``state_dict`` gathers and ``load_state_dict`` cuts the state.
:class:`LocalMode` (one process) lives here; ``ZeroMode`` and ``FsdpMode`` live in
:mod:`tiermem.optim.dist_modes`, which ``choose_mode`` (in :mod:`tiermem.optim.hybrid_adam`)
imports only for a distributed run: a single-process run never imports
:mod:`tiermem.optim.distributed`.

``one_process`` gates what only one process supports (trace placement, ``param_sync=
"forward"``, the parameter watch, forward-order stepping with clipping): those are features,
not different implementations of one operation.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from tiermem._graphs import refuse_capture
from tiermem.optim.layout import Group, StateLayout
from tiermem.optim.local_tensor import local_of
from tiermem.optim.state_dict import param_states
from tiermem.stream.weights import stream_of

GRAPH_FIX = ("capture the model's forward and backward with torch.cuda.make_graphed_callables "
             "(its gradients accumulate after each replay, outside the graph, so these hooks run "
             "eagerly), with param_sync='step', and call step() outside any capture")


def grad_hook(ref: weakref.ref, g: int, i: int, param: torch.Tensor) -> None:
    """A post-accumulate-grad hook's body: the optimizer's mode handles the gradient of local
    tensor ``i`` of group ``g`` if the optimizer still exists (Note [lifetime]).

    Raises:
        RuntimeError: called inside a CUDA graph capture (Note [cuda graphs]).
    """
    refuse_capture("HybridAdam", "a gradient hook", GRAPH_FIX, param)  # Note [cuda graphs]
    opt = ref()
    if opt is not None:
        opt._mode.on_grad(opt, g, i)


class Mode:
    """What a mode decides; the defaults step whole local tensors (one process and FSDP2).

    ``who`` is the error prefix (``"HybridAdam[rank r]"`` under torch.distributed).
    """

    name = "local"
    one_process = True

    def __init__(self, who: str = "HybridAdam") -> None:
        self.who = who

    def attach(self, param_groups: list[dict], device: torch.device) -> None:
        """Set up the mode's communication for the optimizer's groups (collective when
        distributed).

        Raises:
            ValueError: the ranks pass different params (data parallel).
        """

    def local_shapes(self, gi: int, params: list[torch.Tensor]
                     ) -> tuple[list[int], list[int], list | None]:
        """``(elements, bytes per element, segments or None)`` per local tensor of group
        ``gi``."""
        return ([local_of(p).numel() for p in params], [p.element_size() for p in params],
                None)

    def bind(self, groups: list[Group], max_grad_norm: float | None) -> None:
        """Bind the groups (made from :meth:`local_shapes`) to what the mode keeps outside the
        params (streamed weights' host copies and gradients: tiermem/optim/streamed.py)."""

    def buckets_of(self, gi: int) -> dict[int, list[int]]:
        """Reduce bucket -> the local tensors in it (data parallel only)."""
        return {}

    def spill_dir(self, nvme_dir: str | None) -> str | None:
        """The private store's spill directory (per rank when distributed)."""
        return nvme_dir

    def grad_hooks(self, ref: weakref.ref, groups: list[Group], trace: bool) -> list:
        """Register the post-accumulate-grad hooks that feed the CPU side; return their handles."""
        return []

    def on_grad(self, opt: Any, g: int, i: int) -> None:
        """A gradient hook fired for local tensor ``i`` of group ``g``."""

    def begin_step(self) -> None:
        """Forget the last step's gradient bookkeeping."""

    def grad_of(self, g: Group, i: int) -> torch.Tensor | None:
        """Flat gradient of local tensor ``i``, or ``None`` when it has none this step."""
        grad = g.params[i].grad
        return None if grad is None else local_of(grad).view(-1)

    def has_grad(self, g: Group, i: int) -> bool:
        """Whether local tensor ``i`` has a gradient this step."""
        return g.params[i].grad is not None

    def ship_rest(self, opt: Any, ship: Callable[[], None]) -> None:
        """In ``step()``: reduce what backward did not, then ``ship()`` every gradient the
        hooks did not hand over."""
        ship()

    def grads_and_norm(self, groups: list[Group], device: torch.device
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradients clipping scales and their global 2-norm (a 0-d tensor, no host sync)."""
        raise NotImplementedError

    def other_rank_failed(self, failed: bool) -> bool:
        """Whether another rank's CPU step failed (collective when distributed)."""
        return False

    def gather_params(self, groups: list[Group]) -> None:
        """After the CPU side: give every rank every rank's updated params."""

    def refresh_views(self, layout: StateLayout) -> None:
        """Re-take the GPU side's views of the params before they are read (FSDP2)."""

    def param_states(self, layout: StateLayout, device: torch.device) -> list[list[dict]]:
        """The per-param state for ``state_dict()`` (collective when distributed).

        Raises:
            StoreClosedError: the store was closed.
        """
        return param_states(layout)

    def local_state(self, t: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part of saved state tensor ``name`` of ``param``, flat.

        Raises:
            ValueError: a saved tensor that does not fit the param (FSDP2).
        """
        return t.reshape(-1)


class LocalMode(Mode):
    """One process: every param is a local tensor; gradients ship from their own hooks."""

    def grad_hooks(self, ref: weakref.ref, groups: list[Group], trace: bool) -> list:
        return [  # count backward passes always; ship early only with overlap
            g.params[i].register_post_accumulate_grad_hook(
                functools.partial(grad_hook, ref, g.index, i))
            for g in groups
            for i in (range(g.n_local) if trace else g.plan.chunks_of_param)
            if g.params[i].requires_grad]  # frozen: shipped by step() if it has a grad

    def on_grad(self, opt: Any, g: int, i: int) -> None:
        if stream_of(opt._groups[g].params[i]) is not None:  # Note [streamed write-back]
            raise RuntimeError("HybridAdam: a parameter was put into stream_weights after this "
                               "HybridAdam was built; build the WeightStream first, then "
                               "HybridAdam")
        opt._on_grad(g, i)

    def grad_of(self, g: Group, i: int) -> torch.Tensor | None:
        grad = g.params[i].grad
        return None if grad is None else grad.detach().view(-1)

    def grads_and_norm(self, groups: list[Group], device: torch.device
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
        grads = [p.grad for g in groups for p in g.params if p.grad is not None]
        if hasattr(torch.nn.utils, "get_total_norm"):
            return grads, torch.nn.utils.get_total_norm(grads, 2.0)
        return grads, torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
