"""One optimizer step's forward and backward over its micro-batches block by block: each block
runs for every micro-batch while its weights are on the device, once in the forward and once in
the backward (Note [block-major schedule]).

Note [block-major schedule]: with M micro-batches per optimizer step, depth-first (one
micro-batch's forward and backward, then the next) needs every block's weights 2 * M times per
step; when the weights are streamed (Note [weight streaming] in tiermem/stream/weights.py) each
of those crosses PCIe, 2 * M * streamed bytes per step. :func:`block_major_forward_backward`
needs each block twice per step, whatever M:

1. forward, under ``torch.no_grad()``: every micro-batch is embedded; then for block i = 0..n-1
   and micro-batch m = 0..M-1, block i's input for m is saved (kept on the device, or put into a
   :class:`tiermem.TierStore` tier: ``saved_store``/``saved_tier``) and block i runs on it;
2. head: for each micro-batch m in order, its last hidden state ``h`` (as a leaf that requires
   grad) goes through ``model.output``, ``(loss / M).backward()`` runs, and ``h.grad`` is kept;
3. backward: for block i = n-1..0 and micro-batch m = 0..M-1: ``x`` = the saved input (a leaf
   that requires grad), ``y = blocks[i](x)`` (the recomputation), ``torch.autograd.backward(y,
   grad_y[m])``, and ``grad_y[m] = x.grad``; the saved input is dropped;
4. embeddings: for each m in order, ``model.embed(idx)`` again and its backward with
   ``grad_y[m]``.

Why it is the same bits as depth-first. Each micro-batch's computation is unchanged: the same
block on the same input (the forward under ``no_grad`` uses the same kernels as with autograd on
the CPU; on CUDA the attention backend may be chosen by whether its inputs require grad, so the
CUDA tests compare a streamed run with this schedule unstreamed, within its run-to-run noise),
the recomputation reproduces exactly what the forward saved,
and a block's backward gets the same output gradient. Every weight gets its gradients in
micro-batch order 0, 1, ..., M-1, each accumulated by autograd (``grad = g0``, ``grad += g1``,
...) as in the depth-first loop; no weight is used by two of the four stages, so the order in
which the stages interleave does not matter. The loss is divided by M before its backward, as
:func:`tiermem.schedule.micro_batches.forward_backward` does. Tested bit for bit on the CPU
against that loop (tests/schedule/test_micro_batches.py, tests/stream/test_block_major.py).

What it costs (docs/streaming.md, "What each schedule costs"): one more forward of every block
per micro-batch (the recomputation; a checkpointed model pays it already, and the schedule runs
its blocks unwrapped: no second recomputation), the embeddings' forward twice, and the saved
inputs: ``M * batch * seq * d_model`` elements per block, ``n`` blocks of them at the end of the
forward (on the device, or in ``saved_tier``), plus one output gradient per micro-batch
(``M * batch * seq * d_model``) on the device during the backward. Depth-first with
checkpointing keeps ``n`` inputs of one micro-batch.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Hashable, Sequence

import torch

logger = logging.getLogger("tiermem")
_IDS = itertools.count()
SAVED_TIERS = ("gpu", "cpu", "nvme")


class SavedInputs:
    """Each block's input for every micro-batch, from its forward to its backward: kept on the
    device (``store=None``) or in ``store``'s ``tier``, read back to the device in backward
    order one input ahead (Note [block-major schedule]).

    Args:
        store: a :class:`tiermem.TierStore`, or None.
        tier: ``"gpu"``, ``"cpu"`` or ``"nvme"`` (with a store).

    Raises:
        nothing here (the schedule checks the arguments).
    """

    def __init__(self, store: Any, tier: str) -> None:
        self.store = store
        self.tier = tier
        self._uid = next(_IDS)
        self._kept: dict[tuple[int, int], torch.Tensor] = {}
        self._stored: set[Hashable] = set()
        self._held: set[Hashable] = set()

    def _key(self, i: int, m: int) -> Hashable:
        return ("tiermem.block_major", self._uid, i, m)

    def put(self, i: int, m: int, x: torch.Tensor) -> None:
        """Save block ``i``'s input ``x`` of micro-batch ``m``.

        Raises:
            the store's errors (TierFullError: no room in ``tier``).
        """
        if self.store is None:
            self._kept[(i, m)] = x
            return
        key = self._key(i, m)
        self.store.put(key, x, self.tier)
        self._stored.add(key)

    def prefetch(self, i: int, m: int) -> None:
        """Start bringing the input of block ``i``, micro-batch ``m`` to the device (a hint: no
        room means no prefetch).

        Raises:
            nothing beyond the store's closed-store error.
        """
        if self.store is not None:
            self.store.try_prefetch(self._key(i, m), "gpu")

    def get(self, i: int, m: int) -> torch.Tensor:
        """The input of block ``i``, micro-batch ``m``, on the device (held until :meth:`drop`).

        Raises:
            KeyError: not saved; the store's errors (TierFullError, SpillError).
        """
        if self.store is None:
            return self._kept.pop((i, m))
        key = self._key(i, m)
        x = self.store.get(key, "gpu", hold=True)
        self._held.add(key)
        return x

    def drop(self, i: int, m: int) -> None:
        """Forget the input of block ``i``, micro-batch ``m`` (its backward has run).

        Raises:
            the store's errors.
        """
        if self.store is None:
            self._kept.pop((i, m), None)
            return
        key = self._key(i, m)
        if key in self._held:
            self._held.discard(key)
            self.store.release(key)
        if key in self._stored:
            self._stored.discard(key)
            self.store.delete(key)

    def close(self) -> None:
        """Forget every input still saved (after a failure: nothing is left in the store).

        Raises:
            nothing: a store error here is logged (the failure that got here is raised).
        """
        self._kept.clear()
        if self.store is None or self.store.closed:
            return
        for key in list(self._held):
            self._held.discard(key)
            try:
                self.store.release(key)
            except Exception as exc:  # noqa: BLE001  (cleanup after a failure)
                logger.warning("block-major: could not release saved input %r: %s", key, exc)
        for key in list(self._stored):
            self._stored.discard(key)
            try:
                self.store.delete(key)
            except Exception as exc:  # noqa: BLE001
                logger.warning("block-major: could not delete saved input %r: %s", key, exc)


def _stream_of(model: torch.nn.Module) -> Any:
    """The :class:`tiermem.stream.WeightStream` that streams some of ``model.blocks``, or None.

    Raises:
        ValueError: blocks streamed by two streams, or a stream whose blocks are not among
            ``model.blocks`` in their order.
    """
    from tiermem.stream.checks import STREAMED_BLOCKS  # noqa: PLC0415  (keeps this light)

    blocks = list(model.blocks)
    streams: list[Any] = []
    for block in blocks:
        s = STREAMED_BLOCKS.get(block)
        if s is not None and all(s is not t for t in streams):
            streams.append(s)
    if not streams:
        return None
    if len(streams) > 1:
        raise ValueError(f"block_major_forward_backward: model.blocks are streamed by "
                         f"{len(streams)} WeightStreams; a block-major pass drives one stream: "
                         f"stream the blocks with one stream_weights() call")
    stream = streams[0]
    position = {id(b): k for k, b in enumerate(blocks)}
    where = [position.get(id(b)) for b in stream.modules]
    if None in where or where != sorted(where):
        raise ValueError("block_major_forward_backward: the WeightStream of model.blocks "
                         "streams blocks that are not model.blocks in their order; stream "
                         "(a run of) model.blocks in order")
    return stream


def check_saved(saved_store: Any, saved_tier: Any) -> None:
    """Check the saved-input options of the block-major schedule.

    Raises:
        TypeError: ``saved_store`` neither None nor a TierStore.
        ValueError: an unknown ``saved_tier``, ``"nvme"`` on a store without an nvme tier, a
            closed store.
    """
    who = "block_major_forward_backward: "
    if saved_store is None:
        return
    from tiermem.store import TierStore  # noqa: PLC0415

    if not isinstance(saved_store, TierStore):
        raise TypeError(f"{who}saved_store must be a tiermem.TierStore or None (keep the saved "
                        f"inputs on the device), got {type(saved_store).__name__}")
    if saved_store.closed:
        raise ValueError(f"{who}saved_store is closed; pass an open TierStore")
    if saved_tier not in SAVED_TIERS:
        raise ValueError(f"{who}saved_tier={saved_tier!r} is unknown; use 'gpu', 'cpu' "
                         f"(pinned RAM) or 'nvme'")
    if saved_tier == "nvme" and saved_store.config.nvme_bytes == 0:
        raise ValueError(f"{who}saved_tier='nvme' needs a store with an nvme tier "
                         f"(StoreConfig.nvme_bytes=0); set nvme_bytes and nvme_dir, or use "
                         f"saved_tier='cpu'")


def block_major_forward_backward(model: torch.nn.Module,
                                 batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                                 saved_store: Any = None, saved_tier: str = "cpu"
                                 ) -> list[torch.Tensor]:
    """Forward and backward of one optimizer step's micro-batches, block by block (Note
    [block-major schedule]); with a :class:`tiermem.stream.WeightStream` on ``model.blocks``,
    inside one block-major pass of it (Note [block-major passes]): each streamed block is
    fetched once for the forward and once for the backward.

    Each micro-batch's loss is divided by ``len(batches)`` before its backward. Call it through
    :func:`tiermem.schedule.micro_batches.forward_backward` (``block_major=True``), which checks
    the model and the batches first.

    Args:
        model: a :class:`tiermem.models.gpt.DecoderLM` (GPT, MoE) or a module with ``embed``,
            ``blocks`` and ``output``; the blocks are called directly (``model.checkpoint`` is
            not needed: the schedule recomputes each block itself).
        batches: ``(idx, targets)`` per micro-batch.
        saved_store: None (block inputs stay on the device) or a TierStore to keep them in.
        saved_tier: the store tier for them: ``"gpu"``, ``"cpu"`` or ``"nvme"``.

    Returns:
        The loss of each micro-batch (detached, not divided).

    Raises:
        TypeError, ValueError: bad ``saved_store``/``saved_tier``; blocks streamed by two
            streams; the model's own errors.
        RuntimeError: called under ``torch.no_grad()``; a block whose output does not depend
            on its input; the stream's errors (Note [block-major passes]); the store's errors
            (TierFullError) for saved inputs.
    """
    check_saved(saved_store, saved_tier)
    if not torch.is_grad_enabled():
        raise RuntimeError("block_major_forward_backward: called under torch.no_grad(); it "
                           "back-propagates every micro-batch: call it with autograd on")
    stream = _stream_of(model)
    n_micro, n_blocks = len(batches), len(model.blocks)
    saved = SavedInputs(saved_store, saved_tier)
    losses: list[torch.Tensor] = []
    ctx = stream.block_major(n_micro) if stream is not None else contextlib.nullcontext()
    try:
        with ctx:
            with torch.no_grad():
                xs = [model.embed(idx) for idx, _ in batches]
                for i in range(n_blocks):
                    block = model.blocks[i]
                    for m in range(n_micro):
                        saved.put(i, m, xs[m])
                        xs[m] = block(xs[m])
            with _bypass_offload():  # Note [block-major offload]
                order = [(i, m) for i in reversed(range(n_blocks)) for m in range(n_micro)]
                if order:
                    saved.prefetch(*order[0])  # during the head
                grads = []
                for m, (_, targets) in enumerate(batches):
                    h = xs[m].detach().requires_grad_(True)
                    xs[m] = None
                    _, loss = model.output(h, targets)
                    (loss / n_micro).backward()
                    grads.append(h.grad)
                    losses.append(loss.detach())
                for k, (i, m) in enumerate(order):
                    if k + 1 < len(order):
                        saved.prefetch(*order[k + 1])
                    x = saved.get(i, m).detach().requires_grad_(True)
                    y = model.blocks[i](x)
                    torch.autograd.backward(y, grads[m])
                    if x.grad is None:
                        raise RuntimeError(f"block_major_forward_backward: blocks[{i}]'s output "
                                           f"does not depend on its input (no input gradient)")
                    grads[m] = x.grad
                    del x, y
                    saved.drop(i, m)
                for m, (idx, _) in enumerate(batches):
                    e = model.embed(idx)
                    if e.requires_grad:
                        torch.autograd.backward(e, grads[m])
                    grads[m] = None
    finally:
        saved.close()
    return losses


def _bypass_offload() -> Any:
    """Saved-tensor hooks that keep every saved tensor on the device, with autograd's
    in-place check, when an activation offload context is active (Note [block-major offload]);
    a no-op context otherwise.

    Note [block-major offload]: under ``offload_activations`` (tiermem/offload/) a block-major
    step gives the offloader nothing worth moving: the forward phase runs under ``no_grad``
    (nothing is saved), and every tensor the head, a block's recomputation or the embeddings
    save is unpacked by the backward that follows it at once, while the saved block inputs are
    the schedule's own (``saved_store``). Offloading them would copy each recomputed block's
    activations to the host and straight back, every micro-batch. So the schedule's backward
    phase runs under its own ``saved_tensors_hooks`` (innermost hooks win) that keep each
    tensor as ``Kept`` does (detached, its version checked on unpack: Note [saved versions] in
    tiermem/offload/versions.py); the offloader's counters stay at 0 offloaded.

    Raises:
        nothing.
    """
    from tiermem.offload.context import active_offloader  # noqa: PLC0415
    from tiermem.offload.versions import BACKWARD, Kept  # noqa: PLC0415

    if active_offloader() is None:
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(lambda t: Kept(t.detach(), BACKWARD),
                                                    Kept.unpack)
