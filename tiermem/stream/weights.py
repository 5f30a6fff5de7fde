"""Weight streaming: the parameters of chosen blocks live in a TierStore (pinned RAM or NVMe) and
come to the compute device only while their block runs (Note [weight streaming]).

Note [weight streaming]: what autograd saved. A block's forward saves tensors for its backward,
and some of them are its weights, in two forms. (a) A leaf saved as itself (``layer_norm`` saves
``weight``): autograd keeps the Parameter object, and unpacking it in the backward returns that
object with whatever ``.data`` it has *then*; ``param.data = t`` keeps the parameter's version
counter, so the swap does not trip autograd's in-place check. (b) A view of a weight saved by
the op that consumed it (``F.linear`` saves ``weight.t()`` for ``addmm``): that view has its own
TensorImpl, bound to the *storage object* the weight had during the forward, and no later
``param.data = ...`` reaches it. DeepSpeed ZeRO-3 replaces ``param.data`` by an empty tensor
after the forward and gathers it back in a pre-backward hook, which serves (a); for (b) it routes
``F.linear`` through its own autograd function that saves the parameter itself. FSDP instead
keeps one storage per unsharded parameter and frees and refills it in place
(``storage.resize_(0)`` / ``resize_(n)`` + copy), which serves both. We do what FSDP does: each
streamed parameter owns one device ``UntypedStorage`` for the life of the stream
(tiermem/stream/blocks.py). Filling a block resizes each storage to its bytes and copies the host
weight in through a separate tensor (so the parameter's version counter does not move); while
the block computes, ``param.data`` is the full tensor on that storage; releasing it sets
``param.data`` to an empty placeholder and resizes the storage to 0 bytes. A view saved in the
forward still names the same storage, so when the pre-backward hook (a hook on the block's
outputs, which fires before any of the block's backward nodes run) refills it, the backward
reads exactly the bytes the forward read: the host copy, which must not change in between (its
``_version`` is checked at every fill; a change raises). The block is released in the backward
when the post-accumulate-grad hooks of all its trainable streamed parameters have run: every
backward node that reads a weight is an op that had the weight as an input, so its gradient
reaches that weight's AccumulateGrad only after the node has run; AccumulateGrad itself reads
only the parameter's shape and strides, which is why ``param.data`` is the full tensor until
then. A block with frozen weights, or weights that get no gradient in this backward (an idle
MoE expert), also waits for the gradients of its inputs (Note [backward release] in
tiermem/stream/release.py). Whatever is still on the device then is released by a callback
queued on the autograd engine, which runs when the backward ends. Checkpointed blocks
(``torch.utils.checkpoint``, ``use_reentrant=False``) run their forward again inside the
backward, after the pre-backward hook has filled the block: the recomputation finds the weights
ready, saves views of the same storages, and is neither counted as a second call nor released
early (``torch._C._current_graph_task_id() != -1`` tells a recomputation from a forward).

Between passes, ``param.data`` IS the host copy (the store's held pool view for ``tier="cpu"``;
for ``tier="nvme"`` a host tensor whose store copy on NVMe is rewritten at the next pass start
when it changed: ``param._version`` moved, ``param.data`` was replaced, or an optimizer stepped
it; with ``staging_blocks`` no host copy but a stand-in: Note [NVMe home] in nvme_home.py)
and ``param.grad`` the host gradient (Note [host gradients] in tiermem/stream/grads.py), so a
torch optimizer steps the host copies in place and the next forward streams the new weights.
HybridAdam instead connects to the stream (:meth:`WeightStream.connect`): it gets each gradient
from the stream as it lands on the host (Note [streamed gradient hand-off]), writes the new
weights into ``host_copy(param)`` even during a pass, and says so with ``mark_changed`` (Note
[streamed write-back] in tiermem/optim/streamed.py); its steps never set the version guess.
A pass is one forward of the blocks in order, then (when autograd recorded it) its backward:
a block called twice or out of order in a forward, a second forward while the previous one's
graph is alive and not yet back-propagated, an optimizer step over streamed parameters during a
pass, and a backward through a graph whose pass has ended are refused with a RuntimeError.
Several micro-batches block by block (each block for every micro-batch while its weights are on
the device) run in a block-major pass instead, with its own call sequence and checks (Note
[block-major passes] in tiermem/stream/major.py).
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from tiermem.stream.blocks import Block, Fetcher, Param
from tiermem.stream.checks import (STREAMED_BLOCKS, block_params, check_composition,
                                   check_grad_flags, check_host_grads, check_options,
                                   placeholder, replaced, select_frozen, unpinned_warning)
from tiermem.stream.checksums import host_checksum
from tiermem.stream.closing import end_params, read_back
from tiermem.stream.compose import eager as _eager
from tiermem.stream.copies import StreamCopies
from tiermem.stream.grads import HostGrads
from tiermem.stream.interrupted import forward_died, in_backward as _in_backward, running_call
from tiermem.stream.major import BlockMajorPass
from tiermem.stream.nvme_home import home_for
from tiermem.stream.release import BackwardRelease
from tiermem.stream.state_dicts import StateDictHooks
from tiermem.stream.residency import (ResidencyPlan, buffer_blocks_for, kept_blocks_for,
                                      plan_residency)

logger = logging.getLogger("tiermem")
_IDS = itertools.count()

# every parameter a live WeightStream streams -> that stream (stream_of; HybridAdam asks it)
STREAMED_PARAMS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def stream_of(param: torch.Tensor) -> "WeightStream | None":
    """The live :class:`WeightStream` streaming ``param``, or None.

    Raises:
        nothing.
    """
    return STREAMED_PARAMS.get(param)


class _PassToken:
    """Held by the backward hooks of one pass: alive exactly while a graph of it is."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False)
class _Pass:
    next: int = 0                   # the block the forward must call next
    current: int | None = None      # the block whose forward is running
    grad_blocks: list[int] = field(default_factory=list)  # blocks with backward hooks
    token: Any = None               # weakref to the _PassToken of the hooks
    backward_started: bool = False
    release: BackwardRelease = field(default_factory=BackwardRelease)  # Note [backward release]
    call: Any = None                # the running block's call: Note [interrupted forward]
    grads: bool = False             # host gradients taken aside: Note [gradients at backward]

    def graph_alive(self) -> bool:
        return self.token is not None and self.token() is not None


def _pre_backward(ref: Any, i: int, token: Any) -> None:
    me = ref()
    if me is None or me._closed:
        raise RuntimeError(f"weight streaming: backward reached blocks[{i}] through a graph "
                           f"whose pass has ended (its WeightStream was closed)")
    me._pre_backward(i, token)


def stream_weights(blocks: Sequence[nn.Module], *, store: Any, tier: str = "cpu",
                   prefetch_blocks: int = 1, gpu_bytes: int | str | None = None,
                   resident: Sequence[int] | None = None,
                   frozen_only: bool = False,
                   staging_blocks: int | None = None, load_block: Any = None) -> "WeightStream":
    """Stream the weights of ``blocks`` through ``store`` (Note [weight streaming]).

    Args:
        blocks: the blocks (e.g. ``model.blocks``), in execution order; each forward pass must
            call every one of them once, in this order.
        store: the :class:`tiermem.TierStore`; its device is the compute device.
        tier: ``"cpu"`` (the weights stay in the store's pinned RAM pool, which holds them
            all) or ``"nvme"`` (the store copy lives on NVMe and is read through the cpu tier
            before each fill; the optimizer's host copy stays in RAM: docs/streaming.md).
        prefetch_blocks: blocks fetched ahead of the running one (0: each block is fetched
            when it starts); with ``"nvme"`` one more block is read ahead into RAM.
        gpu_bytes: device bytes for these blocks' weights (resident blocks + streaming
            buffers, Note [resident blocks]); the last blocks that fit stay resident. None:
            stream every block (unless ``resident`` names some).
        resident: indices of blocks to keep on the device instead (not with ``gpu_bytes``).
        frozen_only: stream only the weights that do not require grad (a frozen base under
            LoRA adapters); the trainable ones stay ordinary parameters where they are.
        staging_blocks: with ``tier="nvme"``, keep no RAM copy: the weights' only home is
            NVMe, read ahead in execution order into at most this many blocks of RAM staging
            in the store's cpu tier (frozen weights only; Note [NVMe home]). None: a RAM host
            copy of every weight beside the NVMe copy.
        load_block: with ``staging_blocks``, ``load_block(i)`` builds block ``i``'s weights
            (by name) at placement, one block at a time (Note [layer-wise NVMe base]).

    Returns:
        A :class:`WeightStream` (a context manager; ``close()`` makes the parameters ordinary
        device parameters again).

    Raises:
        TypeError, ValueError: bad blocks (meta weights, tied weights across blocks, a block
            streamed already) or options, naming the field and the fix.
        TierFullError: the store has no room for the weights (nothing is changed).
    """
    return WeightStream(blocks, store=store, tier=tier, prefetch_blocks=prefetch_blocks,
                        gpu_bytes=gpu_bytes, resident=resident, frozen_only=frozen_only,
                        staging_blocks=staging_blocks, load_block=load_block)


class WeightStream:
    """Streams the weights of a list of blocks; see :func:`stream_weights` (its arguments).

    Raises:
        the errors of :func:`stream_weights`.
    """

    def __init__(self, blocks: Sequence[nn.Module], *, store: Any, tier: str = "cpu",
                 prefetch_blocks: int = 1, gpu_bytes: int | str | None = None,
                 resident: Sequence[int] | None = None, frozen_only: bool = False,
                 staging_blocks: int | None = None, load_block: Any = None) -> None:
        per_block = select_frozen(block_params(blocks), frozen_only)
        n = len(per_block)
        gpu_bytes, resident = check_options(store, tier, prefetch_blocks, gpu_bytes, resident, n)
        sizes = [sum(p.numel() * p.element_size() for _, p in pairs) for pairs in per_block]
        if resident is not None:
            streamed = tuple(i for i in range(n) if i not in resident)
            largest = max((sizes[i] for i in streamed), default=0)
            k = buffer_blocks_for(prefetch_blocks, len(streamed))
            self.plan = ResidencyPlan(resident=resident, streamed=streamed,
                                      resident_bytes=sum(sizes[i] for i in resident),
                                      buffer_bytes=k * largest, buffer_blocks=k,
                                      kept=kept_blocks_for(streamed, k))
        else:
            self.plan = plan_residency(sizes, gpu_bytes=gpu_bytes,
                                       prefetch_blocks=prefetch_blocks)
        on = self.plan.streamed  # Note [NVMe home]: checked before anything changes
        self._home = home_for(staging_blocks, tier=tier, store=store, indices=on,
                              streamed=[per_block[i] for i in on], load_block=load_block)
        self.store = store
        self.tier = tier
        self.prefetch_blocks = prefetch_blocks
        self.device = store.device
        unpinned = unpinned_warning(store)  # Note [pinned host copies]
        if unpinned is not None:
            logger.warning(unpinned)
        self._modules = list(blocks)
        self._uid = next(_IDS)
        self._copies = StreamCopies(self.device)
        self._fetcher = Fetcher(store, tier, self._copies)
        self._fetcher.home = self._home
        self._grads = HostGrads(self._copies, pin=self._copies.cuda)
        self._pass: _Pass | None = None
        self._major: BlockMajorPass | None = None  # the open block-major pass, if any
        self._stepped = False
        self._closed = False
        self._link: Any = None  # Note [streamed write-back]: the connected optimizer's link
        self._blocks = [Block(i, i in self.plan.streamed) for i in range(n)]
        self._place(per_block)  # the only step that can fail on the store: nothing changed yet
        self._hooks: list[Any] = []
        self._install_hooks()
        for module in self._modules:
            STREAMED_BLOCKS[module] = self
        self._entries = {id(p.param): p for b in self._blocks for p in b.params}
        for p in self._entries.values():
            STREAMED_PARAMS[p.param] = self
        logger.info("weight streaming: %d of %d blocks streamed from %s (%d bytes), %d "
                    "resident (%d bytes), prefetch %d", len(self.plan.streamed), n, tier,
                    sum(sizes[i] for i in self.plan.streamed), len(self.plan.resident),
                    self.plan.resident_bytes, prefetch_blocks)

    # ------------------------------------------------------------------ public API

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The blocks this stream streams (resident ones included), in execution order."""
        return tuple(self._modules)

    @property
    def in_pass(self) -> bool:
        """Whether a forward/backward pass is open (``param.data`` is not the host copy)."""
        return self._pass is not None

    def block_major(self, n_micro: int) -> BlockMajorPass:
        """A block-major pass over ``n_micro`` micro-batches, to enter with ``with``: inside
        it each block runs for every micro-batch while its weights are on the device, the
        forward under ``torch.no_grad()`` and the backward as a recomputation per micro-batch
        (Note [block-major passes]). Used by
        :func:`tiermem.schedule.block_major.block_major_forward_backward`.

        Raises:
            TypeError, ValueError: ``n_micro`` not an int >= 1.
            RuntimeError (on entering): the stream is closed, or a pass is open.
        """
        return BlockMajorPass(self, n_micro)

    def host_copy(self, param: nn.Parameter) -> torch.Tensor:
        """The host copy of streamed ``param``: what the next pass streams, and where an
        optimizer that steps it writes the new weights (Note [streamed write-back]).

        Raises:
            ValueError: ``param`` is not streamed by this stream (resident, or another model's),
                or its home is NVMe (``staging_blocks``: it has no host copy).
        """
        p = self._entry(param)
        if self._home is not None:
            raise ValueError(f"WeightStream.host_copy(): blocks[{p.block.index}].{p.name} has no "
                             f"host copy: its home is NVMe (staging_blocks, Note [NVMe home]); "
                             f"fix: stream with staging_blocks=None to keep one in RAM")
        return p.host

    def host_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The host gradient of streamed ``param``: ``param.grad`` between passes, the one
        being accumulated (Note [host gradients]) during a pass, or None.

        Raises:
            ValueError: ``param`` is not streamed by this stream.
        """
        p = self._entry(param)
        return p.acc if self._pass is not None and self._pass.grads else param.grad

    def mark_changed(self, param: nn.Parameter) -> None:
        """Say that ``param``'s host copy was written (by a connected optimizer): with
        ``tier="nvme"`` the store's copy is rewritten at the next pass start
        (Note [streamed write-back]); with ``tier="cpu"`` the host copy is what the fills read.

        Raises:
            ValueError: ``param`` is not streamed by this stream.
        """
        self._entry(param).written_version = None

    def host_sum(self, param: nn.Parameter) -> int | None:
        """The checksum of ``param``'s host copy known without reading it: its block's first
        fill in the open pass, once landed; else None (Note [streamed write-back checksums]).

        Raises:
            ValueError: ``param`` is not streamed by this stream.
        """
        p = self._entry(param)
        if self._pass is None or p.host.storage_offset() * p.host.element_size() % 8:
            return None  # no pass, or a word grid unlike the device buffer's
        return self._fetcher.checks.first_fill_sum(p.block, p.block.params.index(p))

    def adopt(self, param: nn.Parameter) -> None:
        """Between passes, take a replaced ``param.data`` (``param.data = t``) into the host
        copy now, through the parameter (its ``_version`` moves), instead of at the next pass
        start: a connected optimizer about to read or write the host copy then sees the change
        (Note [param changes]) rather than stepping the old value and having it overwritten by
        ``t`` later. During a pass, or when ``.data`` is the host copy, nothing happens.

        Raises:
            ValueError: ``param`` is not streamed by this stream, or its new data has another
                shape or dtype.
        """
        p = self._entry(param)
        if self._pass is None and replaced(p):
            self._take_replaced(p)

    def connect(self, link: Any) -> None:
        """Connect an optimizer that steps the host copies (Note [streamed write-back]):
        ``link.take(param, host_grad, passes, event)`` receives each streamed gradient
        (``event``: its D2H copy still in flight, or None; Note [streamed gradient hand-off]),
        ``link.before_pass()`` runs before every pass begins; ``connect(None)`` disconnects.
        One optimizer per stream.

        Raises:
            RuntimeError: the stream is closed, a pass is open (connecting; disconnecting
                is allowed then: an optimizer closed or finalized during an evaluation), or
                another optimizer is connected (close it first).
        """
        if link is not None and (self._closed or self._link not in (None, link)):
            why = "is closed" if self._closed else "has an optimizer connected already"
            raise RuntimeError(f"WeightStream.connect(): the stream {why}; one HybridAdam "
                               f"steps a stream's weights: close() the other one first")
        if self._pass is not None and link is not None:  # disconnecting is always allowed:
            raise RuntimeError(  # the pass's later gradients stay the stream's host gradients
                "WeightStream.connect(): a pass is open; connect between passes")
        self._link = link
        self._grads.sink = None if link is None else (
            lambda entry, passes, event: link.take(entry.param, entry.acc, passes, event))
        # Note [last pass sums on the device]
        self._grads.completes = None if link is None else (
            lambda entry: link.completing(entry.param))

    def _entry(self, param: nn.Parameter) -> Param:
        p = self._entries.get(id(param)) if not self._closed else None
        if p is None or p.param is not param:
            raise ValueError("weight streaming: the parameter is not streamed by this "
                             "WeightStream (a resident block's, another model's, or the stream "
                             "is closed); ask stream_of(param) for its stream")
        return p

    def stats(self) -> dict:
        """Counts since the stream began: ``fills`` (blocks copied to the device),
        ``h2d_bytes``, ``peak_blocks`` (streamed blocks on the device at once, at most
        ``plan.buffer_blocks``), ``nvme_writes`` (weights written to the store's NVMe copy),
        ``handed_in_pass`` / ``handed_at_end`` (gradients handed to a connected optimizer
        during a pass / when it ended: Note [hand-off lag]), ``adds_off_thread`` / ``add_waits``
        (host adds of later micro-batches, made on the adder thread / waited for by a take:
        Note [gradient adder]), ``checked_blocks`` (block releases
        whose weights were checksummed: Note [streamed weight checksums]); with
        ``staging_blocks``, ``staging_peak_blocks`` / ``staging_peak_bytes`` (RAM staging) and
        ``read_ahead_blocks`` (Note [NVMe home]).

        Raises:
            nothing.
        """
        home = self._home.stats if self._home is not None else {}
        return dict(self._fetcher.stats, **self._grads.stats(), **self._fetcher.checks.stats,
                    **home)

    def close(self, *, force: bool = False, restore: bool = True) -> None:
        """Stop streaming: every streamed parameter becomes an ordinary parameter on the device
        it had before (data and gradient copied there), the hooks go and the store keys are
        deleted. Idempotent.

        Args:
            force: end an open pass even if its graph is alive (a later backward through that
                graph raises); leaving the ``with`` block on an exception does this.
            restore: False: drop the streamed weights instead (each parameter's data an empty
                placeholder, its gradient None): nothing is copied, so closing at the end of a
                run takes no memory (Note [closing without a copy]).

        Raises:
            TypeError: ``restore`` is not a bool.
            RuntimeError: a pass is open with a live graph and ``force`` is False (run its
                backward first).
            SpillError, SpillCorruption: reading back a weight homed on NVMe failed (the
                stream stays open, nothing changed; Note [NVMe home]).
        """
        if not isinstance(restore, bool):
            raise TypeError(f"WeightStream.close(): restore={restore!r} is not a bool; fix: "
                            f"True (copy the weights back) or False (drop them)")
        if self._closed:
            return
        self._settle_idle_pass()
        if self._pass is not None and force:
            self._end_pass()
        if self._pass is not None:
            what = "a block-major pass is open; leave its context" if self._major is not None \
                else "a forward pass is open and its graph is alive; run its backward (or drop " \
                     "its outputs)"
            raise RuntimeError(f"WeightStream.close(): {what} first")
        if self._link is not None:
            raise RuntimeError("WeightStream.close(): a HybridAdam steps these weights' host "
                               "copies; close() the optimizer first")
        entries = [p for b in self._blocks for p in b.params]
        back = read_back(entries, self._home, restore)  # reads first
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        end_params(self._blocks, back, self.store, self.tier, restore)
        for module in self._modules:
            STREAMED_BLOCKS.pop(module, None)
        for p in self._entries.values():
            STREAMED_PARAMS.pop(p.param, None)
        self._closed = True
        self._fetcher.checks.raise_changed(wait=True)  # closed: Note [streamed weight checksums]

    def __enter__(self) -> "WeightStream":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(force=exc_type is not None)

    # ------------------------------------------------------------------ setup

    def _place(self, per_block: list[list[tuple[str, nn.Parameter]]]) -> None:
        """Put every streamed weight into the store, then make the host copies the
        parameters' data (between passes, Note [weight streaming])."""
        placed: list[Param] = []
        try:
            for i in self.plan.streamed:
                block = self._blocks[i]
                for name, param in per_block[i]:
                    key = ("tiermem.stream", self._uid, i, name)
                    src = param.detach()
                    written_sum = None
                    if self.tier == "cpu":
                        self.store.put(key, src, "cpu")
                        host = self.store.get(key, "cpu", hold=True)
                    elif self._home is not None:  # no RAM copy: a stand-in (Note [NVMe home])
                        host = self._home.place(key, param, i, name)
                    else:
                        host = src.to("cpu", copy=True).contiguous()
                        self.store.put(key, host, "nvme")
                        written_sum = host_checksum(host)
                    storage = torch.empty(0, dtype=param.dtype, device=self.device)
                    p = Param(block, name, param, key, host, storage.untyped_storage(),
                              param.device, written_version=param._version,
                              written_sum=written_sum)
                    placed.append(p)
                    block.params.append(p)
        except BaseException:
            for p in placed:
                if self.tier == "cpu":
                    self.store.release(p.key)
                self.store.delete(p.key)
            for block in self._blocks:
                block.params.clear()
            raise
        for p in placed:
            grad = p.param.grad
            p.param.grad = None
            p.param.data = p.host
            if grad is not None:
                p.param.grad = grad.detach().to("cpu", copy=True)

    def _install_hooks(self) -> None:
        ref = weakref.ref(self)
        for i, module in enumerate(self._modules):
            # Note [compiled blocks]: the hooks run eagerly, never traced
            self._hooks.append(module.register_forward_pre_hook(
                _eager(lambda m, args, kwargs, i=i: ref()._pre_forward(i, (args, kwargs))),
                with_kwargs=True))
            self._hooks.append(module.register_forward_hook(
                _eager(lambda m, args, out, i=i: ref()._post_forward(i, out)),
                always_call=True))
            for p in self._blocks[i].params:
                if p.trainable:
                    self._hooks.append(p.param.register_post_accumulate_grad_hook(
                        lambda param, p=p: ref()._after_accumulate(p)))
        self._hooks += StateDictHooks(self).install()  # Note [streamed state dicts]
        ids = {id(p.param) for b in self._blocks for p in b.params}
        self._hooked = {id(p.param) for b in self._blocks for p in b.params if p.trainable}

        def streams(opt: Any) -> bool:
            return any(id(q) in ids for g in opt.param_groups for q in g["params"])

        def pre_step(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is None or me._closed or not streams(opt):
                return
            me._settle_idle_pass()
            if me._pass is None:  # before the step uses the gradients: wait for the sums
                me._fetcher.checks.raise_changed(wait=True)  # (Note [streamed weight checksums])
            if me._pass is not None:
                raise RuntimeError(f"{type(opt).__name__}.step() during a weight-streaming "
                                   f"pass: the streamed parameters hold no data or gradient "
                                   f"until the backward has ended; step after backward(); drop "
                                   f"outputs no backward will use (or evaluate under no_grad)")

        def post_step(opt: Any, args: Any, kwargs: Any) -> None:
            me = ref()
            if me is not None and not me._closed and me._link is None and streams(opt):
                me._stepped = True  # a torch optimizer stepped the host copies in place

        from torch.optim.optimizer import (  # noqa: PLC0415
            register_optimizer_step_post_hook, register_optimizer_step_pre_hook)
        self._hooks.append(register_optimizer_step_pre_hook(pre_step))
        self._hooks.append(register_optimizer_step_post_hook(post_step))

    # ------------------------------------------------------------------ passes

    def _begin_pass(self) -> None:
        """Host copies -> streaming state: check and take what changed between passes, write
        changed weights to the NVMe copy, move gradients aside (Note [weight streaming])."""
        # the last pass's releases whose sums landed (Note [streamed weight checksums])
        self._fetcher.checks.raise_changed()
        if self._link is not None:
            self._link.before_pass()  # the optimizer's writes of the host copies are complete
        entries = [p for b in self._blocks for p in b.params]
        check_grad_flags(entries, self._hooked)
        check_composition(self._modules, self._blocks)
        taken = [p for p in entries if replaced(p)]  # checks first: a refusal
        if self._home is not None:                     # changes nothing
            self._home.check_unwritten(entries)  # Note [NVMe home]
        check_host_grads(entries)
        for p in taken:
            self._take_replaced(p)
        if self.tier == "nvme" and self._home is None:  # no host copy to write back
            for p in entries:
                now = None
                if not self._stepped and p.written_version == p.param._version:
                    # a .data write moves no version: Note [streamed weight checksums]
                    now = host_checksum(p.host)
                    if now == p.written_sum:
                        continue
                    logger.info("weight streaming: blocks[%d].%s's host copy changed without "
                                "its version moving (a param.data write); the new values are "
                                "streamed", p.block.index, p.name)
                self.store.put(p.key, p.host, "nvme")
                p.written_version = p.param._version
                p.written_sum = host_checksum(p.host) if now is None else now
                self._fetcher.stats["nvme_writes"] += 1
        self._stepped = False
        for p in entries:  # the gradients stay until the backward: Note [gradients at backward]
            p.pass_version = p.param._version
            p.param.data = placeholder(p.host.dtype, self.device)
        for b in self._blocks:
            b.accumulated = 0
        self._fetcher.checks.new_pass(self._blocks)  # Note [streamed weight checksums]
        self._pass = _Pass()

    def _take_replaced(self, p: Param) -> None:
        """Copy a replaced ``.data`` into the host copy, which becomes ``.data`` again."""
        if self._home is not None:
            self._home.take(p)  # into the NVMe copy (Note [NVMe home])
            return
        logger.info("weight streaming: blocks[%d].%s.data was replaced between passes; "
                    "the new values are streamed", p.block.index, p.name)
        new = p.param.data
        p.param.data = p.host
        with torch.no_grad():  # through the parameter: its _version moves, so HybridAdam
            p.param.copy_(new)  # sees the change (Note [param changes]) and keeps it
        p.written_version = None  # the NVMe copy is stale

    def _end_pass(self) -> None:
        """Streaming state -> host copies: every block released, gradients landed."""
        for b in self._blocks:
            if b.streamed:
                self._fetcher.release(b, check=False)  # checked below, with the pass ended
        self._grads.flush()
        taken = self._pass is not None and self._pass.grads  # else .grad stayed the user's
        for b in self._blocks:
            for p in b.params:
                p.param.data = p.host
                if taken:
                    p.param.grad = p.acc
                p.acc = None
        self._pass = None
        self._major = None
        self._grads.raise_failed()  # an adder thread's error, now the pass has ended
        self._fetcher.checks.raise_changed()  # Note [streamed weight checksums]

    def _take_grads(self) -> None:
        """The pass's backward begins: its host gradients go aside, ``.grad`` is None until
        the pass ends (Note [gradients at backward])."""
        entries = [p for b in self._blocks for p in b.params]
        check_host_grads(entries)  # a gradient set during the pass: refused, nothing moved
        for p in entries:
            p.acc, p.param.grad = p.param.grad, None
        self._pass.grads = True

    def _settle_idle_pass(self) -> None:
        """End an open pass that nothing can continue: no block running and no graph of it
        alive (a forward whose outputs were dropped, an evaluation that stopped early), or a
        block's forward left by an interrupt (Note [interrupted forward])."""
        p = self._pass
        if self._major is not None:
            return  # a block-major pass ends when its context is left
        if p is not None and not p.backward_started and (
                p.current is None and not p.graph_alive() or forward_died(p.call)):
            self._end_pass()

    # ------------------------------------------------------------------ hooks

    def _pre_forward(self, i: int, inputs: Any = ()) -> None:
        if self._major is not None:
            self._major.pre_forward(i)
            return
        block = self._blocks[i]
        if _in_backward():  # a checkpointed block's recomputation (Note [weight streaming])
            if self._pass is None or i not in self._pass.grad_blocks:
                raise RuntimeError(
                    f"weight streaming: blocks[{i}] ran inside a backward but its forward "
                    f"recorded no graph in this pass (torch.utils.checkpoint with "
                    f"use_reentrant=True runs it under no_grad, then again in the backward); "
                    f"checkpoint streamed blocks with use_reentrant=False")
            if block.streamed:
                self._fetcher.ready(block)
            return
        if self._pass is not None and i == 0:
            self._settle_idle_pass()
            if self._pass is not None:
                done = self._pass.next == len(self._blocks)
                raise RuntimeError(
                    "weight streaming: blocks[0] called again while the previous forward's "
                    + ("graph is alive and its backward has not run" if done else
                       f"pass is open (it reached blocks[{self._pass.next}])")
                    + "; one forward/backward at a time: run backward() first, drop the "
                      "previous outputs, or evaluate under torch.no_grad() (micro-batches "
                      "block by block: forward_backward(..., block_major=True))")
        if self._pass is None:
            if i != 0:
                raise RuntimeError(f"weight streaming: blocks[{i}] called first in a forward "
                                   f"pass; the blocks run in order from blocks[0]")
            self._begin_pass()
        ps = self._pass
        if i != ps.next:
            what = "called twice in one forward pass" if i < ps.next else \
                f"called before blocks[{ps.next}]"
            raise RuntimeError(f"weight streaming: blocks[{i}] {what}; each pass runs every "
                               f"streamed-list block once, in order (blocks[{ps.next}] is next)")
        ps.current, ps.call = i, running_call(self._modules[i])
        if block.streamed:
            self._fetcher.ready(block)
            if torch.is_grad_enabled():  # Note [backward release]
                ref, pref = weakref.ref(self), weakref.ref(ps)
                ps.release.watch_inputs(block, inputs,
                                        lambda j: ref() and ref()._input_grad(pref, j))
        self._prefetch([j for j in range(i + 1, len(self._blocks)) if self._blocks[j].streamed])

    def _post_forward(self, i: int, out: Any) -> None:
        if self._major is not None:
            self._major.post_forward(i, out)
            return
        if _in_backward() or self._closed:
            return
        ps = self._pass
        if ps is None or ps.current != i:
            return
        ps.current = ps.call = None
        if out is None and sys.exc_info()[0] is not None:  # the block's forward raised
            self._end_pass()
            return
        ps.next = i + 1
        if torch.is_grad_enabled():
            outs = [t for t in tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                token = ps.token() if ps.token is not None else None
                if token is None:
                    token = _PassToken()
                    ps.token = weakref.ref(token)
                ref = weakref.ref(self)
                for t in outs:
                    t.register_hook(lambda g, i=i, token=token: _pre_backward(ref, i, token))
                ps.grad_blocks.append(i)
        keep = i in self.plan.kept and ps.grad_blocks[-1:] == [i]  # Note [kept into backward]
        if self._blocks[i].streamed and not keep:
            try:
                self._fetcher.release(self._blocks[i])
            except BaseException:  # Note [streamed weight checksums]: a weight changed on
                self._end_pass()   # the device; the pass ends, the stream stays usable
                raise
        if ps.next == len(self._blocks) and not ps.grad_blocks:
            self._end_pass()  # no backward will come

    def _pre_backward(self, i: int, token: Any) -> None:
        ps = self._pass
        if ps is None or ps.token is None or ps.token() is not token:
            raise RuntimeError(f"weight streaming: backward reached blocks[{i}] through a "
                               f"graph whose pass has ended (a second backward through a "
                               f"retained graph, or a graph kept from an earlier forward); "
                               f"run one backward per forward")
        try:
            if not ps.backward_started:
                self._take_grads()
                ps.backward_started = True
                ref = weakref.ref(self)
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: ref()._end_of_backward())
            if self._blocks[i].streamed:
                self._fetcher.ready(self._blocks[i])
                ps.release.reached(self._blocks[i])
            upcoming = [j for j in reversed(ps.grad_blocks) if j < i]
            self._prefetch([j for j in upcoming if self._blocks[j].streamed])
            # beside the fills: Note [last pass sums on the device]
            self._grads.upload([p for j in [i] + upcoming[:self.prefetch_blocks]
                                for p in self._blocks[j].params])
        except BaseException:
            self._end_pass()  # the backward fails: the pass is over, the stream stays usable
            raise

    def _after_accumulate(self, p: Param) -> None:
        if self._major is not None:
            self._major.after_accumulate(p)
            return
        ps = self._pass
        if ps is None or not ps.backward_started:
            return  # a backward outside a pass: the gradient stays where autograd put it
        try:
            grad = p.param.grad
            p.param.grad = None
            self._grads.take(p, grad)
            if ps.release.accumulated(p):  # Note [backward release]
                self._fetcher.release(p.block)
        except BaseException:
            self._end_pass()
            raise

    def _input_grad(self, pass_ref: Any, i: int) -> None:
        """An input of blocks[i] has its gradient (Note [backward release])."""
        ps = self._pass
        if ps is None or ps is not pass_ref() or not ps.backward_started:
            return  # a graph of an ended pass, or a backward outside a pass
        try:
            block = self._blocks[i]
            if ps.release.input_grad(block):
                self._fetcher.release(block)
        except BaseException:
            self._end_pass()
            raise

    def _end_of_backward(self) -> None:
        if self._pass is not None:
            self._end_pass()

    def _prefetch(self, upcoming: list[int]) -> None:
        """Fill the next ``prefetch_blocks`` of ``upcoming`` (streamed block indices in
        execution order); with ``tier="nvme"`` read one more into RAM (with ``staging_blocks``
        as many as the staging holds, Note [NVMe home])."""
        for j in upcoming[:self.prefetch_blocks]:
            self._fetcher.fill(self._blocks[j])
        if self._home is not None:
            self._home.read_ahead([self._blocks[j] for j in upcoming[self.prefetch_blocks:]])
        elif self.tier == "nvme":
            mine = ("tiermem.stream", self._uid)
            for j in upcoming[self.prefetch_blocks:self.prefetch_blocks + 1]:
                for p in self._blocks[j].params:  # a hint: only into room, never an error
                    self.store.try_prefetch(p.key, "cpu", keep_extent=True,  # Note [clean reads]
                                            evictable=lambda k: tuple(k[:2]) == mine)
