"""The byte budgets of a :class:`~tiermem.store.store.TierStore` and the eviction engine that
keeps every tier within its own: room is made by finishing moves out of a tier, else by demoting
one victim at a time in the policy's order (gpu -> cpu -> nvme), else a :class:`TierFullError`
says what blocked it. Budgets are hard limits: a move reserves its destination bytes before it
starts and releases its source bytes only when the copy has finished.

Note [cascade]: making room in a tier demotes its victims one tier down, and that demotion makes
room below the same way, so a gpu victim goes to the cpu tier while cpu victims go on to nvme.
An nvme -> gpu promotion reserves its gpu bytes (demoting gpu victims into the cpu tier) before
it takes its cpu staging block, so the victims never compete with the staging block for cpu
room, and once they have landed they are cpu victims for the staging block like any other key.
A cpu -> gpu promotion whose gpu victims find no run of cpu room because the promoted key's own
block splits it (a swap in a fragmented pool) spills that key to nvme first and reloads it from
there (one extra write and read, only then).
Nothing is refused while the tiers below can still take the victims; a refusal says what blocked
it (bytes held by callers, moves in flight, the refusal of the tier below, fragmentation).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

from tiermem.config import TIERS
from tiermem.store.moves import MoveTable
from tiermem.store.pool import HostBlock, block_bytes

_RANK = {t: i for i, t in enumerate(TIERS)}


class TierFullError(MemoryError):
    """A tensor fits in no allowed tier, even after evicting everything evictable."""


class Budgets:
    """The budgets and usage of one store's tiers, owned by it (``TierStore._budgets``).

    Fields, all read and written only under the owning store's lock (``TierStore._lock``):

    - ``budget``: bytes per tier (``StoreConfig.budget``); never changes.
    - ``gpu_used``: device bytes reserved, in-flight copies included (the cpu tier's usage is
      its pool's, the nvme tier's its spill space's).
    - ``peak``: the most bytes each tier has held (raised here and by ``MoveTable.count``).
    - ``refusal``: why the tier below could not take a victim (for the next refusal's message).
    - ``evict_only``: set by ``TierStore.try_prefetch`` for one promotion: evict only the keys
      it allows, and never wait for moves.

    It reads the store's entries, pool, spill space and policy and starts demotions through its
    placement (``TierStore._placer``), all through a weak proxy of the store (no reference cycle
    keeps a dropped store alive); the in-flight moves are ``moves``, the store's table.
    """

    def __init__(self, store: Any, moves: MoveTable) -> None:
        self._store = weakref.proxy(store)
        self._moves = moves
        self.budget = {t: store.config.budget(t) for t in TIERS}
        self.gpu_used = 0
        self.peak = dict.fromkeys(TIERS, 0)
        self.refusal: str | None = None
        self.evict_only: Callable[[Hashable], bool] | None = None

    def reserve_gpu(self, nbytes: int, key: Hashable) -> None:
        """Reserve ``nbytes`` of the gpu budget for ``key``, evicting to make room.

        Raises:
            TierFullError: no room even after evicting (saying what blocked it).
        """
        self.make_room("gpu", nbytes, key)
        self.gpu_used += nbytes
        self.peak["gpu"] = max(self.peak["gpu"], self.gpu_used)

    def release_gpu(self, nbytes: int) -> None:
        """Give back ``nbytes`` of the gpu budget."""
        self.gpu_used -= nbytes

    def alloc_block(self, nbytes: int, key: Hashable, exclude: Hashable = None) -> HostBlock:
        """A cpu pool block of ``nbytes`` for ``key``, evicting (never ``exclude``) for room.

        Raises:
            TierFullError: no room even after evicting (saying what blocked it).
        """
        too_big = self.too_big("cpu", nbytes, key)
        if too_big is not None:
            raise TierFullError(too_big)
        self.refusal = None
        while True:
            block = self._store._pool.alloc(nbytes)
            if block is not None:
                self.peak["cpu"] = max(self.peak["cpu"], self._store._pool.used_bytes)
                return block
            if not self.free_some("cpu", key, exclude):
                raise self.no_room("cpu", nbytes, key)

    def make_room(self, tier: str, nbytes: int, key: Hashable) -> None:
        """Evict from ``tier`` until ``nbytes`` of its budget are free for ``key``.

        Raises:
            TierFullError: no room even after evicting (saying what blocked it).
        """
        too_big = self.too_big(tier, nbytes, key)
        if too_big is not None:
            raise TierFullError(too_big)
        self.refusal = None
        while self.budget[tier] - self._store.used_bytes(tier) < nbytes:
            if not self.free_some(tier, key, key):
                raise self.no_room(tier, nbytes, key)

    def no_room(self, tier: str, nbytes: int, key: Hashable) -> TierFullError:
        """The error of a tier that has no room left for ``key`` after evicting what it could,
        saying what blocked it (Note [cascade])."""
        held = sum(e.nbytes for e in self._store._entries.values()
                   if e.tier == tier and e.holds and e.key != key)
        moving = sum(1 for m in self._moves.moves
                     if tier in (m.src, m.dst) and m.entry.key != key)
        why = []
        if held:
            why.append(f"{held} bytes held by callers (release them)")
        if moving:
            why.append(f"{moving} moves in flight")
        if self.refusal is not None:
            why.append(f"its victims cannot move down: {self.refusal}")
        free = self.budget[tier] - self._store.used_bytes(tier)
        if tier == "cpu" and free >= block_bytes(nbytes):
            why.append(f"{free} bytes are free but not in one run (fragmented)")
        elif tier == "cpu":
            why.append("the rest is staging of moves in progress")
        elif not why:
            why.append("nothing in it can be evicted")
        self.refusal = None
        return TierFullError(f"{tier} tier: no room for {nbytes} bytes of {key!r} (budget "
                             f"{self.budget[tier]}, used {self._store.used_bytes(tier)}; "
                             + "; ".join(why) + ")")

    def free_some(self, tier: str, key: Hashable, exclude: Hashable) -> bool:
        """Free bytes in ``tier``: finish moves out of it, else evict one victim. False: stuck.

        Inside ``TierStore.try_prefetch`` (``evict_only`` set) it never waits and evicts only
        victims that ``evict_only`` allows.
        """
        only = self.evict_only
        # an nvme -> gpu move also holds a cpu staging block until it lands: waiting for it
        # frees cpu bytes too (without this a reload stalls on a cpu tier full of staging)
        leaving = [] if only is not None else [
            m for m in self._moves.moves if m.src == tier
            or (tier == "cpu" and m.src == "nvme" and m.dst == "gpu")]
        if leaving:
            for move in leaving:
                self._moves.finish(move, wait=True)
            return True
        if tier == "nvme":
            return False
        lower = TIERS[_RANK[tier] + 1]
        for victim_key in self._store._policy.victims(tier):
            victim = self._store._entries.get(victim_key)
            if victim is None or victim.tier != tier or victim.holds or victim_key == exclude \
                    or victim.move is not None or victim.nbytes == 0:
                continue
            if only is not None and not only(victim_key):
                continue
            try:
                self._store._placer.demote(victim, lower)
            except TierFullError as exc:
                self.refusal = str(exc)  # the tier below is full of keys it cannot move
                return False
            self._store._policy.on_move(victim_key, tier, lower)
            # its bytes leave this tier only once copied
            self._moves.finish(victim.move, wait=True)
            return victim.tier != tier  # a failed spill reverted it: no room was made
        if only is not None:
            return False
        arriving = [m for m in self._moves.moves
                    if m.dst == tier and m.entry.key != exclude]
        for move in arriving:  # keys still in flight become victims once they land
            try:
                self._moves.finish(move, wait=True)
            except Exception:  # a failed read reverts its key to nvme: room for us either way
                pass
        return bool(arriving)

    def too_big(self, tier: str, nbytes: int, key: Hashable) -> str | None:
        """Why ``tier`` can never take ``nbytes`` for ``key`` whatever it evicts (naming the
        budget to raise), or None when it can."""
        if tier == "nvme" and self._store._spill is None:
            return (f"nvme tier: off (StoreConfig.nvme_bytes=0); set nvme_bytes and nvme_dir to "
                    f"spill {key!r}")
        staged = block_bytes(nbytes)  # pool blocks and spill extents are whole 4096-byte pages
        need = nbytes if tier == "gpu" else staged
        if need > self.budget[tier]:
            return (f"{tier} tier: {nbytes} bytes for {key!r} exceed its budget "
                    f"StoreConfig.{tier}_bytes={self.budget[tier]}"
                    + (f" (in whole 4096-byte pages: {need})" if need != nbytes else ""))
        if tier == "nvme" and staged > self.budget["cpu"]:
            return (f"nvme tier: {nbytes} bytes for {key!r} cannot be spilled or read back: "
                    f"spills and reloads are staged whole through the cpu tier's pool, whose "
                    f"budget StoreConfig.cpu_bytes={self.budget['cpu']} is smaller; raise "
                    f"cpu_bytes to at least {staged}, or split the tensor")
        return None
