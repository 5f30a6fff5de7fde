"""One streamed block's weights on the device: filled from the host copy into per-parameter
device storages, made ready for the compute stream, released (Note [weight streaming] in
tiermem/stream/weights.py).

Each streamed parameter owns one device ``UntypedStorage`` for the life of the stream. Filling
its block resizes it to the parameter's bytes (memory from the compute stream's caching
allocator) and copies the host bytes in; releasing resizes it to 0 bytes. The storage object
itself never changes, which is what lets a backward see the weights that a forward saved
(Note [weight streaming]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import torch
from torch import nn

from tiermem.stream.checks import placeholder
from tiermem.stream.checksums import BufferChecks
from tiermem.stream.copies import StreamCopies


@dataclass(eq=False)
class Param:
    """A streamed parameter and what the stream keeps for it."""

    block: "Block"
    name: str
    param: nn.Parameter
    key: Hashable                  # its key in the TierStore
    host: torch.Tensor  # the host copy: ``param.data`` between passes (Note [NVMe home]: stand-in)
    storage: Any                   # torch.UntypedStorage on the device (0 bytes when released)
    home_device: torch.device      # where the parameter was before streaming (close() returns it)
    acc: torch.Tensor | None = None      # host gradient during a pass (Note [host gradients])
    staging: torch.Tensor | None = None  # pinned staging of a later micro-batch's gradient
    # the step's last pass: ``acc`` uploaded to the device, that upload's event and the
    # backward passes the sum will hold (Note [last pass sums on the device])
    dev_sum: torch.Tensor | None = None
    dev_event: Any = None
    dev_passes: int = 0
    pass_version: int = 0          # param._version when the pass began
    written_version: int | None = None   # nvme: param._version when the store copy was written
    # nvme: the host copy's checksum then (Note [streamed weight checksums])
    written_sum: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the weight."""
        return self.host.numel() * self.host.element_size()

    @property
    def trainable(self) -> bool:
        """Whether autograd computes its gradient."""
        return self.param.requires_grad


@dataclass(eq=False)
class Block:
    """A block of the stream (streamed or resident)."""

    index: int
    streamed: bool
    params: list[Param] = field(default_factory=list)
    state: str = "released"        # "released", "filling" (copy issued) or "ready"
    event: Any = None              # the fill's event (CUDA) or None
    held: list[Hashable] = field(default_factory=list)  # nvme keys held while the copy reads
    accumulated: int = 0           # trainable parameters accumulated in this backward
    sums: Any = None               # the weights' checksums at the fill (BufferChecks)
    first_sums: Any = None         # those of its first fill in this pass (BufferChecks)

    @property
    def nbytes(self) -> int:
        """Bytes of the block's streamed weights."""
        return sum(p.nbytes for p in self.params)


class Fetcher:
    """Fills, readies and releases streamed blocks' device weights.

    Args:
        store: the TierStore holding the weights.
        tier: ``"cpu"`` (the host copy is the store's held pool view) or ``"nvme"`` (the store
            copy is read through the cpu tier's staging before each fill).
        copies: the copy streams.
    """

    def __init__(self, store: Any, tier: str, copies: StreamCopies) -> None:
        self.store = store
        self.tier = tier
        self.copies = copies
        self.device = copies.device
        self.materialized = 0  # streamed blocks filling or ready now
        self.stats = {"fills": 0, "h2d_bytes": 0, "peak_blocks": 0, "nvme_writes": 0}
        self.fault: Any = None  # tests: a callable(block, param, src) -> the tensor to copy
        self._holding: list[Block] = []  # blocks whose fill still reads staging blocks
        self.checks = BufferChecks(copies.cuda)  # Note [streamed weight checksums]
        self.home: Any = None  # the NvmeHome of weights homed on NVMe (Note [NVMe home])

    def fill(self, block: Block) -> None:
        """Start copying ``block``'s weights to the device (nothing if filling or ready).

        Raises:
            RuntimeError: a weight changed in place during the pass (Note [weight streaming]),
                or filled with other values than at its first fill in this pass, or a weight
                found changed on the device (Note [streamed weight checksums]); the fill was
                issued all the same.
            SpillCorruption, SpillError, TierFullError: the store could not read a weight (the
                block stays released, nothing is held).
        """
        if block.state != "released":
            return
        self.sweep()
        self.check_unchanged(block)
        pairs = []
        try:
            if self.home is not None:
                self._stage(block)
            for p in block.params:
                src = p.host
                if self.tier == "nvme":
                    # read only: the extent stays, no rewrite on eviction (Note [clean reads])
                    src = self.store.get(p.key, "cpu", hold=True, keep_extent=True)
                    block.held.append(p.key)
                if self.fault is not None:
                    src = self.fault(block, p, src)
                p.storage.resize_(p.nbytes)
                pairs.append((self._view(p), src))
            block.event = self.copies.fill(pairs, then=lambda: self.checks.filled(
                block, [self._bytes(q) for q in block.params]))
        except BaseException:
            self._free(block)
            raise
        block.state = "filling"
        if block.held:
            self._holding.append(block)
            self.sweep()
        self.materialized += 1
        self.stats["fills"] += 1
        self.stats["h2d_bytes"] += block.nbytes
        self.stats["peak_blocks"] = max(self.stats["peak_blocks"], self.materialized)
        self.checks.raise_changed()  # a refill unlike the first (Note [streamed weight checksums])

    def ready(self, block: Block) -> None:
        """Make ``block``'s weights usable by the caller's stream and point its parameters at
        them (filling first if needed).

        Raises:
            the errors of :meth:`fill`.
        """
        if block.state == "ready":
            self.check_unchanged(block)  # a block kept into the backward: no fill checks it
            return
        self.fill(block)
        self.copies.use(block.event)
        for p in block.params:
            p.param.data = self._view(p)
        block.state = "ready"

    @staticmethod
    def check_unchanged(block: Block) -> None:
        """Refuse a weight of ``block`` changed in place since the pass began.

        Raises:
            RuntimeError: naming the weight and its versions.
        """
        for p in block.params:
            if p.param._version != p.pass_version:
                raise RuntimeError(
                    f"weight streaming: blocks[{block.index}].{p.name} was changed in place "
                    f"during the forward/backward pass (version {p.pass_version} -> "
                    f"{p.param._version}): the forward used the old values, so the backward "
                    f"would be wrong; change weights only between passes (after backward)")

    def release(self, block: Block, check: bool = True) -> None:
        """Free ``block``'s device weights (its parameters become empty placeholders); a block
        made ready has its weights' checksums compared with the fill's
        (Note [streamed weight checksums] in tiermem/stream/checksums.py).

        Args:
            check: raise (after freeing) for a weight changed on the device that is known by
                now; False: leave it to a later :meth:`BufferChecks.raise_changed`.

        Raises:
            RuntimeError: with ``check``, a streamed weight was changed in place on the device
                during the pass (the block is freed first).
        """
        if block.state == "released":
            return
        self.copies.use(block.event)  # later kernels may reuse this memory only after the fill
        if block.state == "ready":  # else its parameters never pointed at the buffer
            self.checks.released(block, [self._bytes(p) for p in block.params])
        block.sums = None
        for p in block.params:
            p.param.data = placeholder(p.host.dtype, self.device)
        self._free(block)
        self.materialized -= 1
        block.state = "released"
        if check:
            self.checks.raise_changed()

    def sweep(self) -> None:
        """Give the store back the staging blocks (nvme) of every fill that has landed.

        Raises:
            nothing beyond the store's errors.
        """
        keep = []
        for block in self._holding:
            if block.event is None or block.event.query():
                self._unhold(block)
            else:
                keep.append(block)
        self._holding = keep

    def _unhold(self, block: Block) -> None:
        if block.held:
            self.copies.landed(block.event)  # the store may reuse a staging block once read
            for key in block.held:
                self.store.release(key)
            block.held.clear()
        if self.home is not None:
            self.home.unstage(block)  # back to nvme, no write (Note [NVMe home])

    def _stage(self, block: Block) -> None:
        """Make room for ``block`` in the NVMe home's staging, then count it (Note [NVMe
        home]): drop a read-ahead block, else wait for the oldest fill's copy to land."""
        home = self.home
        while not home.staged(block) and home.full():
            victim = home.victim(self._holding)
            if victim is not None:
                home.unstage(victim)
            elif self._holding:
                # a host sync: its copy must land before its staging block can be given back
                self._unhold(self._holding.pop(0))
            else:
                raise RuntimeError("weight streaming: the NVMe staging is full with no block to "
                                   "give back (a stream bug: Note [NVMe home])")
        home.stage(block)

    def _free(self, block: Block) -> None:
        """Give back the storages and the staging blocks held for the fill."""
        self._unhold(block)
        if block in self._holding:
            self._holding.remove(block)
        for p in block.params:
            p.storage.resize_(0)
        block.event = None

    def _view(self, p: Param) -> torch.Tensor:
        """The parameter's full tensor on its device storage."""
        out = torch.empty(0, dtype=p.host.dtype, device=self.device)
        return out.set_(p.storage, 0, p.host.shape)  # contiguous (an NVMe stand-in's stride is 0)

    def _bytes(self, p: Param) -> torch.Tensor:
        """The parameter's device storage as bytes (what its checksum sums, whatever the
        weight's strides: Note [streamed weight checksums])."""
        out = torch.empty(0, dtype=torch.uint8, device=self.device)
        return out.set_(p.storage, 0, (p.nbytes,))
