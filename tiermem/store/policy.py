"""Eviction policies: which resident keys of a full tier move down first.

A policy only orders candidates; the store decides what is evictable (not held by a caller,
not in flight) and enforces budgets. :class:`Policy` has five methods: the store tells it about
every access (``on_access``) and every move (``on_move``) and asks it for ``victims`` (the one
method a subclass must define); ``bind(store)`` (once, when the store is made) and
``mark_step()`` (at each ``TierStore.mark_step()``) do nothing unless a subclass needs them.
The policies ``StoreConfig.policy`` names are made by :func:`tiermem.store.policies.make_policy`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterator

from tiermem.config import TIERS


class Policy:
    """Base class of eviction policies (subclass it to write your own)."""

    def bind(self, store: Any) -> None:
        """Attach to the :class:`~tiermem.TierStore` that uses this policy.

        The store calls it once, at the end of its constructor, before any access. The default
        does nothing; a subclass may keep ``store`` to read key sizes (``store.nbytes_of``) and
        may refuse a second store by raising.

        Raises:
            Nothing by default; a subclass may raise ValueError (e.g. already bound to another
            store), which the store's constructor passes on.
        """

    def mark_step(self) -> None:
        """A training step ended: ``TierStore.mark_step()`` calls it, with the store's lock held.

        The default does nothing; a subclass may end a recorded step or reset per-step state
        (the trace policy does both).

        Raises:
            Nothing by default.
        """

    def on_access(self, key: Hashable, tier: str) -> None:
        """``key`` (now in ``tier``) was put, read or prefetched.

        Raises:
            Nothing by default.
        """

    def on_move(self, key: Hashable, old_tier: str | None, new_tier: str | None) -> None:
        """``key`` moved between tiers (``None``: it entered or left the store).

        Raises:
            Nothing by default.
        """

    def victims(self, tier: str) -> Iterator[Hashable]:
        """Yield keys resident in ``tier`` in the order they should be evicted.

        Raises:
            NotImplementedError: a subclass that does not define it.
        """
        raise NotImplementedError(f"{type(self).__name__}.victims is missing; a Policy subclass "
                                  f"must define victims(tier)")


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
