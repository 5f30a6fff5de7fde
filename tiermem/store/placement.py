"""Placement of a :class:`~tiermem.store.store.TierStore`: the copies that start a key's moves
between tiers (a put's first copy, promotions, demotions, the nvme detour of Note [cascade]),
each with the completion and the revert it hands to the store's :class:`MoveTable`.

Every copy here goes through the store's :class:`~tiermem.store.transfer.Copier` (its H2D and
D2H streams and events) or its spill space; the streams and events are the copier's, and each
use keeps its one-line reason.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any

import torch

from tiermem.store.budgets import Budgets, TierFullError
from tiermem.store.clean import after_read_up, drop_kept, reuse_kept
from tiermem.store.moves import MoveTable, _Move
from tiermem.store.nvme import SpillFull
from tiermem.store.pool import HostBlock, HostPool
from tiermem.store.transfer import Copier, TransferFuture


class Placement:
    """Starts the moves of one store, which owns it (``TierStore._placer``); holds no state.

    Every method runs under the owning store's lock (``TierStore._lock``), on a settled entry
    (no move of it in flight) unless it says otherwise. It changes the entry's fields
    (``tier``, ``device_buf``, ``block``, ``extent``), reserves and releases bytes through
    ``budgets``, records each move it starts in ``moves``, and reads the store's spill space,
    policy, device and recorder through a weak proxy (no reference cycle keeps a dropped store
    alive). The completions it hands to ``moves`` run under the same lock.
    """

    def __init__(self, store: Any, moves: MoveTable, budgets: Budgets, copier: Copier,
                 pool: HostPool) -> None:
        self._store = weakref.proxy(store)
        self._moves = moves
        self._budgets = budgets
        self._copier = copier
        self._pool = pool

    def place(self, entry: Any, tier: str, flat: torch.Tensor, owns: bool) -> None:
        """Put the bytes ``flat`` (on the CPU or the device) into ``tier`` for a new entry."""
        n = entry.nbytes
        entry.tier = tier
        if n == 0:
            return
        too_big = self._budgets.too_big(tier, n, entry.key)
        if too_big is not None:
            raise TierFullError(too_big)
        if tier == "gpu":
            self._budgets.reserve_gpu(n, entry.key)
            if flat.device == self._store.device:
                entry.device_buf = flat if owns else flat.clone()
                return
            self._moves.count("cpu", "gpu", n)
            buf = self._copier.alloc_device(n)
            event = self._copier.h2d(buf, flat)
            entry.device_buf = buf
            self._moves.start(entry, None, "gpu", self._moves.event_future(event), keep=[flat])
            return
        try:
            block = self._budgets.alloc_block(n, entry.key)
        except TierFullError as exc:
            if tier == "cpu":
                raise
            raise TierFullError(f"nvme tier: no cpu staging block for the spill: {exc}") from None
        event = self.copy_to_block(block, flat)
        if flat.device.type != "cpu":
            self._moves.count("gpu", "cpu", n)
        if tier == "cpu":
            entry.block = block
            # no reference to a device source is kept: d2h() marked it used by the D2H stream,
            # so its memory is reused only after the copy, whenever the caller drops it
            self._moves.start(entry, None, "cpu", self._moves.event_future(event))
            return
        if event is not None:
            event.synchronize()  # the staging block must hold the bytes before the disk write
        entry.block = block
        entry.tier = "cpu"
        try:
            self.demote(entry, "nvme")
        except TierFullError:
            self._pool.free(block)
            entry.block = None
            raise

    def promote(self, entry: Any, tier: str) -> None:
        """Start moving a settled entry up into ``tier``."""
        entry.holds += 1  # making room below must not pick this entry as a victim
        try:
            self.start_promote(entry, tier)
        finally:
            entry.holds -= 1

    def start_promote(self, entry: Any, tier: str) -> None:
        key, n = entry.key, entry.nbytes
        if n == 0:
            entry.tier = tier
            return
        if entry.tier == "nvme":
            device_buf = None
            if tier == "gpu":  # gpu room first: its victims must not compete with the staging
                self._budgets.reserve_gpu(n, key)  # block for cpu room (Note [cascade])
            try:
                block = self._budgets.alloc_block(n, key)
            except TierFullError:
                if tier == "gpu":
                    self._budgets.release_gpu(n)
                raise
            if tier == "gpu":
                device_buf = self._copier.alloc_device(n)
            extent, spill = entry.extent, self._store._spill
            future = TransferFuture()
            read = spill.read(key, extent, block.tensor)

            def after_read(f, fref=weakref.ref(future), copier=self._copier,
                           device_buf=device_buf, block=block):
                # runs on an I/O thread; needs no store lock (see ``moves.py``). It refers
                # to neither the store nor (strongly) the future that holds ``f``: no reference
                # cycle keeps a dropped store alive until the next garbage collection
                future = fref()
                if future is None:  # the move was dropped with its store
                    return
                if f.exception() is not None:
                    future._set_error(f.exception())
                elif device_buf is None:
                    future._set_future(f)
                else:
                    future._set_event(copier.h2d(device_buf, block.tensor[:n]))

            read.add_done_callback(after_read)
            entry.tier, entry.extent = tier, None
            if device_buf is None:
                entry.block = block
            else:
                entry.device_buf = device_buf

            def done(extent=extent, block=block, device_buf=device_buf):
                after_read_up(entry, extent, spill)  # kept or freed: Note [clean reads]
                if device_buf is not None:
                    self._pool.free(block)

            def fail(exc, extent=extent, block=block, device_buf=device_buf):
                self._pool.free(block)
                if device_buf is not None:
                    self._budgets.release_gpu(n)
                entry.tier, entry.extent, entry.block, entry.device_buf = "nvme", extent, None, None

            self._moves.moves.append(_Move(entry, "nvme", tier, future, done, fail))
            entry.move = self._moves.moves[-1]
            if self._store._recorder is not None:
                entry.move.started_s = time.perf_counter()
            self._moves.count("nvme", tier, n)
            return
        # cpu -> gpu
        try:
            self._budgets.reserve_gpu(n, key)
        except TierFullError:
            if not self.detour_via_nvme(entry):
                raise
            try:
                self.start_promote(entry, tier)  # now from nvme (Note [cascade])
            except TierFullError:
                self._store._policy.on_move(key, "cpu", "nvme")  # it stays there
                raise
            return
        buf = self._copier.alloc_device(n)
        block = entry.block
        event = self._copier.h2d(buf, block.tensor[:n])
        entry.tier, entry.device_buf, entry.block = "gpu", buf, None

        def done_h2d(block=block):
            self._pool.free(block)

        def fail_h2d(exc, block=block):
            self._budgets.release_gpu(n)
            entry.tier, entry.block, entry.device_buf = "cpu", block, None

        self._moves.add(entry, "cpu", "gpu", self._moves.event_future(event), done_h2d, fail_h2d)

    def detour_via_nvme(self, entry: Any) -> bool:
        """Spill a cpu entry whose own block keeps its gpu victims out of the cpu tier (the
        free room around it is fragmented), so it can be reloaded from nvme (Note [cascade]).
        False, changing nothing, where that cannot help or is not allowed (try_prefetch)."""
        if self._budgets.evict_only is not None or self._store._spill is None \
                or not self._store._spill.fits(entry.nbytes):
            return False
        try:
            self.demote(entry, "nvme")
            self._moves.settle(entry)
        except (TierFullError, OSError):
            return False
        return entry.tier == "nvme"  # a failed spill reverted it to cpu

    def demote(self, entry: Any, tier: str) -> None:
        """Start moving a settled entry one tier down (gpu -> cpu or cpu -> nvme)."""
        key, n = entry.key, entry.nbytes
        if n == 0:
            entry.tier = tier
            return
        if tier == "cpu":
            block = self._budgets.alloc_block(n, key, exclude=key)
            buf = entry.device_buf
            event = self._copier.d2h(block.tensor[:n], buf)
            entry.tier, entry.block, entry.device_buf = "cpu", block, None

            def done_d2h():
                self._budgets.release_gpu(n)

            def fail_d2h(exc, buf=buf, block=block):
                self._pool.free(block)
                entry.tier, entry.block, entry.device_buf = "gpu", None, buf

            self._moves.add(entry, "gpu", "cpu", self._moves.event_future(event), done_d2h,
                            fail_d2h, keep=[buf])
            return
        if self._store._spill is None:
            raise TierFullError(f"cannot spill {key!r}: the nvme tier has no budget "
                                f"(set StoreConfig.nvme_bytes and nvme_dir)")
        block = entry.block
        kept = reuse_kept(entry)
        if kept is not None:  # unchanged since a clean read: no write (Note [clean reads])
            self._demote_into_kept(entry, block, kept)
            return
        try:
            write = self._write(key, block, n)
        except SpillFull as exc:  # Note [spill errors]: at once, so put() can pick another tier
            raise TierFullError(f"nvme tier full: {exc}") from exc
        future = TransferFuture()
        future._set_future(write)
        entry.tier, entry.block = "nvme", None

        def done_write(block=block, write=write):
            entry.extent = write.result()
            self._pool.free(block)

        def fail_write(exc, block=block):
            warnings.warn(f"tiermem: spilling {key!r} failed ({exc}); it stays in the cpu tier",
                          RuntimeWarning, stacklevel=3)
            self._budgets.refusal = f"spilling {key!r} failed ({exc})"
            entry.tier, entry.block, entry.extent = "cpu", block, None
            # a victim candidate of the cpu tier again
            self._store._policy.on_move(key, "nvme", "cpu")

        self._moves.add(entry, "cpu", "nvme", future, done_write, fail_write)

    def _write(self, key: Any, block: HostBlock, n: int) -> Any:
        """Start spilling ``block``'s first ``n`` bytes; a full spill space first gives up
        the kept extents (Note [clean reads]) and is tried once more."""
        spill = self._store._spill
        try:
            return spill.write(key, block.tensor, n)
        except SpillFull:
            if not drop_kept(self._store._entries.values(), spill):
                raise
        return spill.write(key, block.tensor, n)

    def _demote_into_kept(self, entry: Any, block: HostBlock, kept: Any) -> None:
        """Move a cpu entry to nvme into its kept extent: nothing is written, the block is
        freed when the (already finished) move is applied (Note [clean reads])."""
        entry.tier, entry.block, entry.extent = "nvme", None, kept
        self._moves.kept_bytes += entry.nbytes

        def done(block=block):
            self._pool.free(block)

        def fail(exc, block=block):  # a finished future never fails; kept for the table
            entry.tier, entry.block, entry.extent = "cpu", block, None
            self._store._spill.free(kept)

        move = _Move(entry, "cpu", "nvme", TransferFuture.completed(), done, fail)
        self._moves.moves.append(move)
        entry.move = move

    def copy_to_block(self, block: HostBlock, flat: torch.Tensor) -> torch.cuda.Event | None:
        dst = block.tensor[:flat.numel()]
        if flat.device.type == "cuda":
            return self._copier.d2h(dst, flat)
        dst.copy_(flat)
        return None
