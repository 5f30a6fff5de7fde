"""Eviction policies: which resident keys of a full tier move down first.

A policy only orders candidates; the store decides what is evictable (not held by a caller,
not in flight) and enforces budgets. Policies are told about every access and every move, so
one written by a user needs only these three methods (``on_access``, ``on_move``,
``victims``); the store also calls ``bind(store)`` and ``mark_step()`` on a policy that has them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator

from tiermem.config import TIERS


class Policy:
    """Base class of eviction policies (subclass it to write your own)."""

    def on_access(self, key: Hashable, tier: str) -> None:
        """``key`` (now in ``tier``) was put, read or prefetched."""

    def on_move(self, key: Hashable, old_tier: str | None, new_tier: str | None) -> None:
        """``key`` moved between tiers (``None``: it entered or left the store)."""

    def victims(self, tier: str) -> Iterator[Hashable]:
        """Yield keys resident in ``tier`` in the order they should be evicted."""
        raise NotImplementedError


class LRUPolicy(Policy):
    """Least recently used first, per tier."""

    def __init__(self) -> None:
        self._order: dict[str, OrderedDict] = {t: OrderedDict() for t in TIERS}

    def on_access(self, key: Hashable, tier: str) -> None:
        order = self._order[tier]
        order[key] = None
        order.move_to_end(key)

    def on_move(self, key: Hashable, old_tier: str | None, new_tier: str | None) -> None:
        if old_tier is not None:
            self._order[old_tier].pop(key, None)
        if new_tier is not None:
            self._order[new_tier][key] = None

    def victims(self, tier: str) -> Iterator[Hashable]:
        return iter(list(self._order[tier]))


def make_policy(policy: str | Policy) -> Policy:
    """Return a policy object for a name (``"lru"``) or pass an instance through.

    Raises:
        ValueError: unknown policy name.
        TypeError: an object that is not a :class:`Policy`.
    """
    if isinstance(policy, Policy):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "trace":
        from tiermem.schedule.trace import StepOrdinalKeys, TracePolicy  # execution order

        # activation-offload keys are new each step: match them by their order in the step
        return TracePolicy(key_fn=StepOrdinalKeys.activations())
    if isinstance(policy, str):
        raise ValueError(f"StoreConfig.policy={policy!r} is unknown; use 'lru', 'trace' or a Policy")
    raise TypeError(f"StoreConfig.policy must be 'lru', 'trace' or a tiermem Policy, "
                    f"got {type(policy).__name__}")
