"""HybridAdam over streamed weights: the hand-off between a :class:`tiermem.stream.WeightStream`
and HybridAdam's chunk flow (issue 29 items 2 and 3; docs/streaming.md).

Note [streamed write-back]: a streamed weight (``stream_weights``) lives on the host between
passes; its ``.data`` is the stream's host copy then, a device tensor or an empty placeholder
during a pass (Note [weight streaming]). HybridAdam steps such a weight through the host copy,
never through ``param.data``: :class:`StreamedMode` puts ``stream.host_copy(param)`` into the
group's ``host_copies``, and ``local_view`` (tiermem/optim/layout.py), through which HybridAdam
reads a weight (the masters at step 0, a changed weight: Note [param changes]; one changed
through ``param.data``, seen by checksums: Note [streamed write-back checksums]) and writes it
(the worker's copy out of the param-out ring, the GPU lane's cast, the GPU side's copy), returns
it for these weights (and the worker's kernel writes it itself for a chunk that is all one
piece of such a weight: Note [in-place host chunks] in chunk_worker.py). So an updated chunk
goes from the CPU step into the host copy that the next pass streams (``tier="cpu"``: the
store's held pool view, in place; ``tier="nvme"``: the host copy, and the store's NVMe copy is
rewritten at the next pass start because HybridAdam calls ``stream.mark_changed(param)`` for
every weight it stepped, before that pass begins), and nothing is copied back to the device.
Gradients come the other way: HybridAdam registers no gradient hook on a streamed weight; the
stream hands each one over at its take, with the event of its D2H copy still in flight
(Note [streamed gradient hand-off] in tiermem/stream/grads.py), and :func:`on_host_grad` counts it
and ships it like HybridAdam's own hook (``_on_grad``) would: as soon as the step's last
backward pass has handed it over (overlap, no clipping; the worker waits for the copy), else in
``step()`` from ``param.grad``, which is the same host tensor between passes. A host copy is
written only after its weight's gradient of the step's last backward pass was taken, and in
that pass its block is never filled again (forward first, each block's backward fill before
its gradients; block-major: one backward fill per pass), so no fill reads a half-written
copy; a weight that has no gradient is not written. Before every pass the stream calls
``before_pass``: HybridAdam completes a pending step (with ``param_sync="forward"`` the worker
may still be writing host copies) and marks what it stepped.
Why it is exact: the same gradients (Note [host gradients]: the same adds in the same order),
the same state and kernels per element, and the weight the next forward reads is the one
HybridAdam wrote; chunks, the GPU side and the lane are elementwise, so the partition between
them changes no bit on the CPU. What differs on CUDA: a streamed weight's share of the GPU side
(``offload_fraction < 1``) keeps its state on the host and steps there with torch's fused Adam
(its gradient and weight are on the host), so its bits follow the CPU kernel, not the CUDA one.
Not supported: data parallel and FSDP2 (refused), a HybridAdam built before the stream (its
gradient hook refuses), two optimizers over one stream (``connect`` refuses). Under a
GradScaler: Note [streamed grad scaler] in amp_scaling.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from tiermem.optim.layout import Group
from tiermem.optim.modes import LocalMode, grad_hook
from tiermem.stream.grad_norms import total_norm
from tiermem.stream.weights import stream_of


def stand_ins(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` with each streamed weight replaced by an empty tensor of its dtype on its
    stream's compute device (where HybridAdam steps it from), for the device check.

    Raises:
        nothing.
    """
    out = []
    for p in params:
        s = stream_of(p)
        out.append(p if s is None else torch.empty(0, dtype=p.dtype, device=s.device))
    return out


def streamed_mode(params: list[torch.Tensor], distributed: bool) -> "StreamedMode | None":
    """The mode for ``params`` when some are streamed (None when none is).

    Raises:
        ValueError: streamed weights with data parallel or FSDP2.
    """
    streams = {id(p): s for p in params if (s := stream_of(p)) is not None}
    if not streams:
        return None
    if distributed:
        raise ValueError("HybridAdam: streamed weights (stream_weights) with data_parallel or "
                         "FSDP2 params are not supported; train streamed weights in one process")
    return StreamedMode(streams)


class StreamedMode(LocalMode):
    """One process with streamed weights (Note [streamed write-back]).

    Args:
        streams: ``id(param)`` -> the WeightStream streaming it.
    """

    name = "local+stream"

    def __init__(self, streams: dict[int, Any]) -> None:
        super().__init__()
        self._streams = streams
        self.norm_counts: dict[str, int] = {}  # Note [streamed gradient norms]

    def bind(self, groups: list[Group], max_grad_norm: float | None) -> None:
        """Point each streamed local tensor at its host copy (``Group.host_copies``); the clip of
        their host gradients is settle's (``max_grad_norm`` unused: Note [streamed rollback]).

        Raises:
            nothing.
        """
        for g in groups:
            for i, p in enumerate(g.params):
                s = self._streams.get(id(p))
                if s is not None:
                    g.host_copies[i] = s.host_copy(p)

    def grad_hooks(self, ref: weakref.ref, groups: list[Group], trace: bool) -> list:
        """LocalMode's hooks on the resident params; each stream connected to a :class:`Link`
        for the streamed ones (its ``remove`` disconnects, with the hooks).

        Raises:
            RuntimeError: a stream has another optimizer connected.
        """
        hooks = [g.params[i].register_post_accumulate_grad_hook(
                     functools.partial(grad_hook, ref, g.index, i))
                 for g in groups
                 for i in (range(g.n_local) if trace else g.plan.chunks_of_param)
                 if g.params[i].requires_grad and i not in g.host_copies]
        where = {id(g.params[i]): (g.index, i) for g in groups for i in g.host_copies}
        for stream in {id(s): s for s in self._streams.values()}.values():
            link = Link(ref, stream, where)
            try:
                stream.connect(link)
            except BaseException:
                for h in hooks:
                    h.remove()
                raise
            stream._grads.norms.want = link.wants_norm  # Note [streamed gradient norms]
            hooks.append(link)
        return hooks

    def begin_step(self) -> None:
        """Forget the last step's norms of the streamed gradients (Note [streamed gradient
        norms]: a norm lives for one step).

        Raises:
            nothing.
        """
        super().begin_step()
        self.forget_norms()

    def forget_norms(self) -> None:
        """Drop the norms taken of the streamed gradients this step: a step's end, or an
        unscale that rewrote the gradients without moving a version (Note [streamed grad
        scaler] in amp_scaling.py).

        Raises:
            nothing.
        """
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream._grads.norms.clear()

    def grads_and_norm(self, groups: list[Group], device: torch.device
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """LocalMode's gradients and global norm, a streamed gradient's norm taken from its
        take on the device where it has one (Note [streamed gradient norms]); sets
        ``norm_counts`` (``norms_precomputed`` / ``norms_computed``: streamed gradients whose
        norm was taken before ``step()`` / in it) for ``step_stats``.

        Raises:
            Nothing beyond torch's errors.
        """
        grads: list[torch.Tensor] = []
        norms: list[torch.Tensor | None] = []
        streamed = 0
        for g in groups:
            for p in g.params:
                grad = p.grad
                if grad is None:
                    continue
                s = self._streams.get(id(p))
                streamed += s is not None
                grads.append(grad)
                norms.append(None if s is None else s._grads.norms.lookup(grad))
        found = sum(n is not None for n in norms)
        if not hasattr(torch.nn.utils, "get_total_norm"):  # an older torch: LocalMode's rule
            found = 0
        self.norm_counts = {"norms_precomputed": found, "norms_computed": streamed - found}
        if not found:
            return super().grads_and_norm(groups, device)
        return grads, total_norm(grads, norms)

    def grad_of(self, g: Group, i: int) -> torch.Tensor | None:
        """A streamed weight's host gradient (during a pass the stream's, not ``.grad``)."""
        s = self._streams.get(id(g.params[i])) if i in g.host_copies else None
        if s is None:
            return super().grad_of(g, i)
        grad = s.host_grad(g.params[i])
        return None if grad is None else grad.detach().view(-1)


class Link:
    """What a WeightStream calls HybridAdam through (weakly: Note [lifetime]).

    Args:
        ref: a weak reference to the HybridAdam.
        stream: the WeightStream.
        where: ``id(param)`` -> ``(group, local tensor)`` of every streamed weight.
    """

    def __init__(self, ref: weakref.ref, stream: Any, where: dict[int, tuple[int, int]]) -> None:
        self._ref = ref
        self._stream = stream
        self._where = where
        self._marked: dict[tuple[int, int], int] = {}  # (g, i) -> steps when last marked

    def take(self, param: torch.Tensor, grad: torch.Tensor, passes: int,
             event: Any = None) -> None:
        """The stream's gradient hand-off (Note [streamed gradient hand-off]); ``event``: the
        D2H copy still writing ``grad`` (CUDA), or None.

        Raises:
            the errors of shipping the gradient (HybridAdam's ``_ship``).
        """
        opt = self._ref()
        item = self._where.get(id(param))
        if opt is not None and item is not None:
            on_host_grad(opt, *item, grad, passes, event)

    def completing(self, param: torch.Tensor) -> int | None:
        """The backward passes ``param``'s gradient will hold after one more take, when that
        take completes its step (reaches ``grad_accumulation_steps``), else None: the stream
        then sums that take on the device (Note [last pass sums on the device] in
        tiermem/stream/grads.py).

        Raises:
            nothing.
        """
        opt = self._ref()
        item = self._where.get(id(param))
        if opt is None or item is None:
            return None
        passes = opt._step.acc_count.get(item, 0) + 1
        return passes if passes >= opt.grad_accumulation_steps else None

    def wants_norm(self, passes: int) -> bool:
        """Whether a gradient taken whole into an empty host gradient, covering ``passes``
        backward passes, completes it for the step and its norm is wanted: HybridAdam clips,
        with ``overlap=True`` (gradients final when backward ends), and ``passes`` reaches
        ``grad_accumulation_steps`` (Note [streamed gradient norms]); not once a GradScaler
        drives the steps (the norm would be the scaled gradient's, dropped at the unscale:
        Note [streamed grad scaler] in amp_scaling.py).

        Raises:
            nothing.
        """
        opt = self._ref()
        return (opt is not None and opt.max_grad_norm is not None and opt.overlap
                and passes >= opt.grad_accumulation_steps and not opt._spec.amp.seen)

    def before_pass(self) -> None:
        """Before a pass: complete a pending step, mark the weights it wrote changed.

        Raises:
            RuntimeError: the CPU step failed.
        """
        opt = self._ref()
        if opt is None:
            return
        opt.synchronize()  # the worker may still write host copies (param_sync="forward")
        for (g, i) in self._where.values():
            steps = opt._groups[g].steps[i]
            if self._marked.get((g, i), 0) != steps:
                self._marked[(g, i)] = steps
                p = opt._groups[g].params[i]
                if stream_of(p) is self._stream:
                    self._stream.mark_changed(p)  # HybridAdam wrote its host copy

    def between_steps(self, what: str) -> None:
        """Before ``what`` reads or loads the host copies (``model.state_dict()`` /
        ``load_state_dict()``, Note [streamed state dicts] in tiermem/stream/state_dicts.py):
        complete a pending step (its worker may still write them), and refuse while chunks of
        a step ``step()`` has not taken yet were stepped (Note [state between steps]).

        Raises:
            RuntimeError: the CPU step failed, or ``what`` falls between backward and step.
        """
        opt = self._ref()
        if opt is None:
            return
        self.before_pass()
        opt._step.drain(f"{what} over weights HybridAdam steps")

    def remove(self) -> None:
        """Disconnect from the stream (HybridAdam's close or finalizer).

        Raises:
            nothing.
        """
        if not self._stream.closed and self._stream._link is self:
            self._stream.connect(None)
        norms = self._stream._grads.norms
        if norms.want == self.wants_norm:
            norms.want = None
            norms.clear()


def on_host_grad(opt: Any, g: int, i: int, grad: torch.Tensor, passes: int,
                 event: Any = None) -> None:
    """A streamed weight's host gradient, complete for ``passes`` more backward passes once
    ``event`` (its D2H copy in flight, or None) has: count it, and ship it with ``event`` when
    it is the step's last, like HybridAdam's ``_on_grad`` (Note [stepping order], Note [trace
    placement]); the chunk worker waits on ``event`` before it reads the gradient
    (``host_grads_landed`` in chunk_worker.py). A gradient left to ``step()`` is shipped after
    the pass ended, when every copy has landed.

    Raises:
        the errors of HybridAdam's ``_ship``.
    """
    step = opt._step
    with step.lock:
        count = step.acc_count.get((g, i), 0) + passes
        step.acc_count[(g, i)] = count
        if not opt._state_ready:  # Note [trace placement]: the first backward only records
            opt._arrived.setdefault((g, i), len(opt._arrived))
            return
        if (not opt._layout.backward_order or count < opt.grad_accumulation_steps
                or (g, i) in step.shipped or i not in opt._groups[g].plan.chunks_of_param):
            return  # step() ships it (Note [stepping order])
    opt._ship(g, i, event)  # its gradient: StreamedMode.grad_of, the stream's host gradient
