"""Streamed weights whose only home is NVMe: no RAM copy, a bounded RAM staging area in the
store's cpu tier, read ahead in execution order (Note [NVMe home]).

Note [NVMe home]: ``stream_weights(..., tier="nvme", staging_blocks=k)`` keeps a streamed weight
in the store's nvme tier only. Without ``staging_blocks`` a ``tier="nvme"`` stream keeps a RAM
host copy of every weight beside its NVMe copy (the copy an optimizer steps, Note [weight
streaming]), so RAM must hold the whole model; with it RAM holds at most ``k`` blocks' weights
whatever the model's size:

- **Placement.** Each weight is ``put`` into the nvme tier straight from the parameter (the
  store stages it through one pool block), and ``param.data`` becomes a *stand-in*: a CPU tensor
  of the weight's shape and dtype whose elements all alias one NaN (``torch.full((1,), nan)
  .expand(shape)``): no RAM, the parameter's shape, numel and dtype as before, NaN in any
  computation made with it between passes. torch refuses most in-place writes to it (more than
  one element refers to one memory location); one it lets through (``fill_``, ``zero_``) moves
  the parameter's ``_version`` and every pass start refuses it until ``.data`` is replaced.
  Replacing it (``param.data = t``, same shape and dtype) is taken at the next pass start (or
  ``adopt()``): ``t`` is written to the NVMe copy and ``.data`` is the stand-in again.
- **Staging.** A block is *staged* while its weights are in the store's cpu tier because the
  stream read them: a block being filled (its keys held until its copy to the device landed,
  ``Fetcher.sweep``) and blocks read ahead (``try_prefetch`` into free room only) in the order
  ``WeightStream._prefetch`` is given: forward order, the backward's reverse, block-major's two
  phases. At most ``k`` blocks are staged. A filled block is evicted back to nvme as soon as its
  copy has landed: the read was clean (Note [clean reads] in tiermem/store/clean.py), so that
  frees the pool block and writes nothing. A fill that finds ``k`` blocks staged drops a
  read-ahead block (the last read ahead: needed latest), else waits for the oldest fill's copy
  to land (a host sync, only when ``k`` is below the fills in flight: ``prefetch_blocks + 2``
  on CUDA at most; on the CPU a fill has landed when it returns). The RAM the stream holds is
  therefore at most ``k`` x the largest streamed block in whole 4096-byte pages per weight
  (:func:`staging_bytes`), which the store's ``cpu_bytes`` must hold (checked); the default of
  :func:`tiermem.models.lora_stream.stream_lora_base` is ``prefetch_blocks + 2``.
- **Frozen weights only.** A trained weight is refused at ``stream_weights``: HybridAdam writes
  each new weight into ``host_copy(param)`` during a pass, chunk by chunk (Note [streamed
  write-back]), and a weight without a host copy has nowhere for it; a write-back through the
  staging to NVMe would be a change to the optimizer, not made here. The LoRA base (frozen,
  ``frozen_only=True``) is what this is for.
- **I/O failures.** A read that fails raises the store's ``SpillError`` / ``SpillCorruption``,
  which names the key (``("tiermem.stream", stream id, block, weight name)``) and the spill
  file; the fill leaves its block released with nothing held or staged, the pass ends, and the
  NVMe copy is untouched: the next pass reads again. A read-ahead that failed is dropped
  quietly (the fill that needs the weight raises the error).
- ``close()`` reads every weight back to the device it came from (all reads first: a failed one
  leaves the stream open, nothing changed) and deletes the keys.

Note [layer-wise NVMe base]: a base larger than RAM *and* the device cannot be built whole and
then streamed. ``stream_weights(..., staging_blocks=k, load_block=f)`` instead takes blocks
whose streamed parameters are stand-ins (:func:`stand_in`: shape and dtype, no memory) and, at
placement, calls ``f(i)`` for each streamed block in order: it builds or loads block ``i``'s
weights (a dict by parameter name, e.g. on the device), which are written to NVMe and dropped
before the next block is asked for; at most one block's tensors live at once. Such weights
never existed anywhere else, so ``close()`` leaves the stand-ins (it reads nothing back) and
deletes the keys. :func:`tiermem.models.lora_layerwise.layerwise_lora_llama` builds a LoRA Llama
so.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from tiermem.names import check_int, short_repr
from tiermem.store.nvme import SpillError
from tiermem.store.pool import block_bytes

logger = logging.getLogger("tiermem")


def staging_bytes(block_sizes: Sequence[Sequence[int]], staging_blocks: int) -> int:
    """RAM the staging of ``staging_blocks`` blocks may hold: that many of the largest block,
    each weight in whole pool pages (Note [NVMe home]).

    Args:
        block_sizes: per streamed block, the bytes of each of its weights.
        staging_blocks: blocks staged at once.

    Raises:
        nothing: arithmetic on ints.
    """
    largest = max((sum(block_bytes(n) for n in sizes) for sizes in block_sizes), default=0)
    return min(staging_blocks, len(block_sizes)) * largest


def home_for(staging_blocks: Any, *, tier: str, store: Any,
            streamed: Sequence[Sequence[tuple[str, nn.Parameter]]],
            indices: Sequence[int], load_block: Any = None) -> "NvmeHome | None":
    """Check ``stream_weights``' ``staging_blocks`` (Note [NVMe home]); return the
    stream's :class:`NvmeHome`, or None.

    Args:
        staging_blocks: None (a RAM host copy of every weight) or blocks staged in RAM.
        tier: the stream's tier.
        store: the TierStore (its ``cpu_bytes`` must hold the staging).
        streamed: the ``(name, parameter)`` pairs of each streamed block.
        indices: those blocks' indices.
        load_block: None, or ``load_block(i)`` -> block ``i``'s weights by name, written to
            NVMe instead of the parameters' data (Note [layer-wise NVMe base]).

    Raises:
        TypeError: not an int; ``load_block`` not callable.
        ValueError: below 1, a tier other than ``"nvme"``, a streamed weight that requires
            grad, or a staging area larger than the store's ``cpu_bytes``; one line naming
            the field, the value and the fix.
    """
    who = "stream_weights: "
    if load_block is not None and not callable(load_block):
        raise TypeError(f"{who}load_block must be a callable (block index -> its weights by "
                        f"name), got {type(load_block).__name__}")
    if staging_blocks is None:
        if load_block is not None:
            raise ValueError(f"{who}load_block builds weights whose only home is NVMe; fix: "
                             f"give staging_blocks (e.g. prefetch_blocks + 2) and tier='nvme'")
        return None
    check_int(who, "staging_blocks", staging_blocks, low=1, unit="blocks",
              fix="give e.g. prefetch_blocks + 2, or None for a RAM copy of every weight")
    if tier != "nvme":
        raise ValueError(f"{who}staging_blocks={staging_blocks} bounds the RAM staging of "
                         f"weights whose home is NVMe, but tier={short_repr(tier)} keeps every "
                         f"weight in RAM; fix: tier='nvme', or drop staging_blocks")
    for i, pairs in zip(indices, streamed):
        for name, param in pairs:
            if param.requires_grad:
                raise ValueError(
                    f"{who}staging_blocks={staging_blocks} keeps no RAM copy of blocks[{i}]."
                    f"{name}, which requires grad (an optimizer steps a streamed weight's RAM "
                    f"host copy, Note [NVMe home]); fix: frozen_only=True (stream the frozen "
                    f"weights only), freeze it, or staging_blocks=None")
    need = staging_bytes([[p.numel() * p.element_size() for _, p in pairs]
                          for pairs in streamed], staging_blocks)
    have = store.config.budget("cpu")
    if need > have:
        raise ValueError(f"{who}staging_blocks={staging_blocks} stages up to {need} bytes "
                         f"(that many of the largest streamed block) in the store's RAM, more "
                         f"than StoreConfig.cpu_bytes={have}; fix: raise cpu_bytes to at least "
                         f"{need} or lower staging_blocks")
    home = NvmeHome(store, staging_blocks, need, load_block)
    home.last_names = {i: pairs[-1][0] for i, pairs in zip(indices, streamed) if pairs}
    return home


def stand_in(like: torch.Tensor) -> torch.Tensor:
    """``param.data`` between passes for a weight homed on NVMe: ``like``'s shape and dtype on
    the CPU, every element one aliased NaN (0 for a dtype without NaN), no RAM.

    Raises:
        nothing.
    """
    fill = float("nan") if like.dtype.is_floating_point or like.dtype.is_complex else 0
    return torch.full((1,), fill, dtype=like.dtype).expand(like.shape)


class NvmeHome:
    """The RAM staging of a stream whose weights live on NVMe only (Note [NVMe home]).

    Args:
        store: the TierStore.
        staging_blocks: blocks staged at once (>= 1, checked by :func:`home_for`).
        bound_bytes: what they may hold (:func:`staging_bytes`); the placement's writes in
            flight are kept within it too.
        load_block: None, or ``load_block(i)`` -> block ``i``'s weights by name, placed
            instead of the parameters' data (Note [layer-wise NVMe base]).

    Raises:
        nothing at construction.
    """

    def __init__(self, store: Any, staging_blocks: int, bound_bytes: int,
                 load_block: Any = None) -> None:
        self.store = store
        self.load_block = load_block  # Note [layer-wise NVMe base]
        self._loaded: tuple[int, dict] | None = None  # the block load_block gave last
        self.last_names: dict[int, str] = {}  # block -> the name placed last in it
        self.limit = staging_blocks
        self.bound_bytes = bound_bytes
        self._writing = 0  # bytes of placement writes that may still hold pool blocks
        self._staged: dict[int, Any] = {}  # block index -> Block, in the order staged
        self.stats = {"staging_peak_blocks": 0, "staging_peak_bytes": 0, "read_ahead_blocks": 0}

    # ------------------------------------------------------------------ placement

    def place(self, key: Hashable, param: nn.Parameter, block: int, name: str) -> torch.Tensor:
        """Write ``param``'s weight (blocks[``block``].``name``; with ``load_block``, what it
        gives for it) to the nvme tier under ``key``; return its stand-in.

        Raises:
            ValueError: ``load_block`` gave no tensor of the parameter's shape and dtype.
            the errors of ``TierStore.put`` and ``load_block`` (nothing is stored then).
        """
        src = param.detach()
        if self.load_block is not None:  # Note [layer-wise NVMe base]
            if self._loaded is None or self._loaded[0] != block:
                self._loaded = None  # the last block's tensors go first
                self._loaded = (block, dict(self.load_block(block)))
            src = self._loaded[1].get(name)
            if not isinstance(src, torch.Tensor) or src.shape != param.shape \
                    or src.dtype != param.dtype:
                what = "nothing" if src is None else (
                    f"a {src.dtype} tensor of shape {tuple(src.shape)}"
                    if isinstance(src, torch.Tensor) else type(src).__name__)
                raise ValueError(f"stream_weights: load_block({block}) gave {what} for {name!r}; "
                                 f"fix: give the {param.dtype} tensor of shape "
                                 f"{tuple(param.shape)} under that name")
        nbytes = block_bytes(param.numel() * param.element_size())
        if self._writing and self._writing + nbytes > self.bound_bytes:
            self.store.synchronize()  # the writes in flight free their pool blocks: RAM bound
            self._writing = 0
        self.store.put(key, src, "nvme")
        self._writing += nbytes
        if self.last_names.get(block) == name:
            self._loaded = None  # the block is written: its loaded tensors can go
        return stand_in(param)

    def check_unwritten(self, entries: Sequence[Any]) -> None:
        """At a pass start: refuse a stand-in written in place since it was set, or replaced by
        a copy of itself (all NaN: ``model.to()``), which would overwrite the NVMe copy
        (Note [NVMe home]); any other replaced ``.data`` is taken by :meth:`take`.

        Raises:
            ValueError: naming the weight and the fix (the NVMe copy unchanged; a stand-in's
                copy is replaced by the stand-in again).
        """
        for p in entries:
            data = p.param.data
            if data.data_ptr() != p.host.data_ptr() and data.is_floating_point() \
                    and data.numel() and bool(torch.isnan(data).all()):
                p.param.data = p.host  # the NVMe copy is kept: the stream stays usable
                raise ValueError(
                    f"weight streaming: blocks[{p.block.index}].{p.name}.data was replaced by "
                    f"a tensor of NaN only, a copy of its stand-in (model.to() or .cuda() "
                    f"between passes copies it; Note [NVMe home]); its NVMe copy is kept and "
                    f".data is the stand-in again; fix: leave streamed blocks where they are "
                    f"(the stream moves them), or assign the real values")
            if data.data_ptr() == p.host.data_ptr() and p.param._version != p.written_version:
                raise ValueError(
                    f"weight streaming: blocks[{p.block.index}].{p.name} was written in place "
                    f"between passes (version {p.written_version} -> {p.param._version}), but "
                    f"its home is NVMe and it has no RAM copy to write (staging_blocks, Note "
                    f"[NVMe home]); fix: assign the new values (param.data = new_tensor), or "
                    f"close() the stream before editing the weights")

    def take(self, p: Any) -> None:
        """Write a replaced ``p.param.data`` to the NVMe copy; ``.data`` is the stand-in again.

        Raises:
            the errors of ``TierStore.put`` (the old NVMe copy and ``.data`` stay then).
        """
        logger.info("weight streaming: blocks[%d].%s.data was replaced between passes; the new "
                    "values are written to its NVMe home", p.block.index, p.name)
        self.unstage(p.block)  # between passes nothing holds its keys
        self.store.put(p.key, p.param.data.detach(), "nvme")
        p.host = stand_in(p.host)  # a fresh one: a fill_ may have written the old one
        p.param.data = p.host
        p.written_version = p.param._version

    def restore(self, params: Sequence[Any]) -> list[torch.Tensor]:
        """Each weight read back onto the device it came from (``close()``): all reads first.

        Raises:
            SpillError, SpillCorruption, TierFullError: a read failed (nothing changed).
        """
        for b in list(self._staged.values()):
            self.unstage(b)
        if self.load_block is not None:  # Note [layer-wise NVMe base]: NVMe was its only home
            return [p.host for p in params]
        out = []
        for p in params:
            t = self.store.get(p.key, "cpu", hold=True, keep_extent=True)  # a clean read
            try:
                out.append(t.to(p.home_device, copy=True))
            finally:
                self.store.release(p.key)
            self.store.evict(p.key, "nvme")  # keeps the staging bound: frees RAM, no write
        return out

    # ------------------------------------------------------------------ staging

    def staged(self, block: Any) -> bool:
        """Whether ``block``'s weights are (being read) in the store's RAM.

        Raises:
            nothing.
        """
        return block.index in self._staged

    def full(self) -> bool:
        """Whether ``staging_blocks`` blocks are staged.

        Raises:
            nothing.
        """
        return len(self._staged) >= self.limit

    def victim(self, holding: Sequence[Any]) -> Any:
        """A staged block no fill reads (a read-ahead one): the last staged, or None.

        Raises:
            nothing.
        """
        busy = {b.index for b in holding}
        for i in reversed(self._staged):
            if i not in busy:
                return self._staged[i]
        return None

    def stage(self, block: Any) -> None:
        """Count ``block`` as staged (its fill or read-ahead reads it into RAM now).

        Raises:
            nothing.
        """
        self._staged[block.index] = block
        st = self.stats
        st["staging_peak_blocks"] = max(st["staging_peak_blocks"], len(self._staged))
        now = sum(sum(block_bytes(p.nbytes) for p in b.params) for b in self._staged.values())
        st["staging_peak_bytes"] = max(st["staging_peak_bytes"], now)

    def unstage(self, block: Any) -> None:
        """Evict ``block``'s weights back to nvme (a clean read: no write) and stop counting it.

        Raises:
            ValueError: a key of the block is held (a fill still reads it).
            TierFullError: the nvme tier has no room for a weight whose clean copy the store
                gave up (the block stays staged).
        """
        if block.index not in self._staged:
            return
        for p in block.params:
            try:
                if self.store.tier_of(p.key) != "nvme":
                    self.store.evict(p.key, "nvme")
            except SpillError as exc:  # a read-ahead failed: the key stays on NVMe, and the
                # fill that needs it raises, naming the key and file
                logger.debug("weight streaming: read-ahead of %r failed: %s", p.key, exc)
        del self._staged[block.index]

    def read_ahead(self, blocks: Sequence[Any]) -> None:
        """Read the released ``blocks`` (streamed, in execution order) into RAM while fewer
        than ``staging_blocks`` are staged: a hint, into the store's free room only.

        Raises:
            StoreClosedError: the store is closed.
        """
        for b in blocks:
            if self.full():
                return
            if b.state != "released" or self.staged(b):
                continue
            started = [self.store.try_prefetch(p.key, "cpu", keep_extent=True)
                       for p in b.params]
            if all(f is None for f in started):
                return  # no free room: stop here (a hint)
            self.stage(b)
            self.stats["read_ahead_blocks"] += 1
