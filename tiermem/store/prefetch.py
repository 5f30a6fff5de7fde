"""Lookahead prefetch along the recorded step: fetch what comes next as far ahead as room allows.

After each access the :class:`Prefetcher` walks the next ``lookahead`` accesses of the trace
policy's recording, in order, and for each key that sits below the tier its access needs, calls
``TierStore.try_prefetch`` (any tier pair: nvme -> cpu, cpu -> gpu, nvme -> gpu). The store then
uses free room, and may evict only keys whose next use comes *later* than the prefetched key's
(see Note [next use] in trace.py): a prefetch never pushes out anything needed sooner, so it
cannot make a key that is needed first miss, and never waits for room. A victim must moreover
be needed no sooner than every key accessed between now and the prefetched access will be
needed again after it: then it is the key MIN itself would evict at that access, so evicting it
early costs no extra move (without this rule, evicting B now, needed in 50 accesses, to make room
for K needed in 5, is a loss when A, used in 1 and then in 100, is the better victim at K's
access). The walk stops at the
first key that finds no room ("as far ahead as the budgets allow"): fetching later keys into the
room a sooner one lacks would only be undone.

Budgets stay hard limits: the store reserves a prefetch's destination bytes before the copy
starts and takes victims through its normal eviction path.

Never evicted by a prefetch: the key of the access that triggered it (its caller is about to
use the returned tensor), keys held or in flight; and nothing at all while a dead key of the
tier (one whose value leaves the store before its next use, see Note [deaths] in trace.py)
leaves before the prefetched access: room then frees by itself, and MIN would not evict at
that access, so an eviction now could only add moves; the prefetch uses free room only. Keys
regenerated each step (a put comes next) are skipped until they exist, and so are keys whose
value leaves the store before their next use (nothing would read the prefetched copy).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from tiermem.config import TIERS
from tiermem.store.trace import TracePolicy

_RANK = {t: i for i, t in enumerate(TIERS)}


class Prefetcher:
    """Issues lookahead prefetches for a store whose policy is a :class:`TracePolicy`.

    Made by the store when ``StoreConfig.prefetch_lookahead`` > 0, which calls
    :meth:`after_access` after every ``put``/``get``/``prefetch``; can also be made and driven
    by hand.

    Args:
        store: the :class:`~tiermem.TierStore`.
        policy: the store's trace policy (its recording says what comes next).
        lookahead: recorded accesses looked at after each access (>= 1).
        evict: let a prefetch evict keys needed later than the prefetched one (False: free
            room only).

    Raises:
        TypeError: ``policy`` is not a :class:`TracePolicy`.
        ValueError: ``lookahead`` < 1.
    """

    def __init__(self, store: Any, policy: Any, lookahead: int, *, evict: bool = True) -> None:
        if not isinstance(policy, TracePolicy):
            raise TypeError(f"StoreConfig.prefetch_lookahead={lookahead} needs the trace policy "
                            f"(StoreConfig.policy='trace' or a TracePolicy instance), got "
                            f"{type(policy).__name__}; or set prefetch_lookahead=0")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"Prefetcher: lookahead={lookahead!r} must be an int >= 1 (accesses)")
        self.store = store
        self.policy = policy
        self.lookahead = lookahead
        self.evict = evict
        self.counts = dict(issued=0, issued_bytes=0, no_room=0)
        """``issued``: prefetches started, ``issued_bytes`` their bytes, ``no_room``: walks that
        stopped at a key without room."""
        self._busy = False

    def after_access(self, key: Hashable | None = None) -> int:
        """Prefetch the next recorded accesses; return how many moves were started.

        Args:
            key: the key just accessed (never evicted by these prefetches).
        """
        policy, store = self.policy, self.store
        if self._busy or not policy.following:
            return 0
        self._busy = True  # try_prefetch does not call back, but a user's policy might
        started = 0
        try:
            seen: set = set()
            window = policy.upcoming(self.lookahead)
            for i, acc in enumerate(window):
                if acc.key in seen or acc.tier == "nvme":
                    continue
                seen.add(acc.key)
                target = policy.key_of(acc.key)
                if target is None or target == key or target not in store:
                    continue  # made anew this step (a put comes), or gone
                try:
                    tier = store.tier_of(target)
                except KeyError:
                    continue
                if _RANK[tier] <= _RANK[acc.tier]:
                    continue
                need = policy.next_use(target)
                if need == math.inf:
                    continue  # its value leaves the store before anything reads it
                bound = self._bound(window, i) if self.evict else math.inf

                def evictable(victim: Hashable, need: float = need, bound: float = bound,
                              target: Hashable = target) -> bool:
                    if victim == key or victim == target:
                        return False
                    dist = policy.next_use(victim)
                    return dist > need and dist >= bound

                # room that a dead key frees before the access comes for free: no eviction then
                evict = self.evict and not policy.frees_room(acc.tier, need)
                future = store.try_prefetch(target, acc.tier,
                                            evictable=evictable if evict else None)
                if future is None:
                    self.counts["no_room"] += 1
                    break
                started += 1
                self.counts["issued"] += 1
                self.counts["issued_bytes"] += acc.nbytes
        finally:
            self._busy = False
        return started

    def _bound(self, window: list, index: int) -> float:
        """Distance (from the current position) of the furthest next use, after access
        ``index`` of ``window``, of the keys accessed up to it: a victim needed before that
        would not be the one MIN evicts when ``window[index]`` is needed (see the module
        docstring), so evicting it early could cost a move."""
        trace, start = self.policy.trace, self.policy.position
        after = start + index + 1
        if after >= len(trace):  # the window wrapped into the next step: no cheap bound
            return math.inf
        return max((trace.next_use(acc.key, after) + index + 1 for acc in window[:index + 1]),
                   default=0)
