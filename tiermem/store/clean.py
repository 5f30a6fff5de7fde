"""Clean reads of a :class:`~tiermem.store.store.TierStore`: a key read up from NVMe by a
caller that only reads it keeps its NVMe extent, so evicting it again unchanged costs no write
(Note [clean reads]).

Note [clean reads]: a read up from the nvme tier normally frees the key's extent once the bytes
have landed in RAM (or on the device), because the caller gets a view of the store's memory and
may write through it: the extent would then be stale. A caller that only reads (the weight
stream copying a block to the device) says so with ``keep_extent=True`` on ``get``,
``prefetch`` or ``try_prefetch``; the extent then stays allocated as the key's *kept* copy
(``_Entry.kept``) while the key lives in a higher tier, and demoting the key to nvme again
reuses it: the pool block is freed and nothing is written. The kept copy is valid exactly while
no view that could be written has been handed out since the read, so:

- every read call records its ``keep_extent`` on the entry (``_Entry.keep_extent``); the read's
  completion keeps the extent only if the flag is still set when it lands (a plain ``get``
  issued while the read is in flight clears it, and the completion frees the extent);
- a read call with ``keep_extent=False`` (the default: today's behaviour) frees a kept extent
  at once: a kept copy never lives while the key is in flight from nvme (it is made when such
  a move completes and consumed or freed before the next one starts), so no read of it runs;
- ``put`` replaces the entry and ``delete`` drops it: the kept extent is freed with it;
- kept extents count toward the nvme tier's used bytes (they are allocated); a write that finds
  the spill space full frees every kept extent (they are only a saving) and tries once more.

The caller's promise is not checked: writing through a view returned with ``keep_extent=True``
leaves a stale NVMe copy that a later eviction would keep. The store's own moves never write
a key's bytes.
"""

from __future__ import annotations

from typing import Any, Iterable


def note_read(entry: Any, keep_extent: bool, spill: Any) -> None:
    """Record a read of ``entry`` (Note [clean reads]): keep or give up its NVMe copy.

    Args:
        entry: the store's ``_Entry``.
        keep_extent: the caller only reads the key.
        spill: the store's ``SpillSpace`` (None: no nvme tier).

    Raises:
        nothing beyond ``SpillSpace.free``'s ValueError for an extent not allocated there.
    """
    entry.keep_extent = bool(keep_extent)
    if not keep_extent and entry.kept is not None:
        spill.free(entry.kept)
        entry.kept = None


def after_read_up(entry: Any, extent: Any, spill: Any) -> None:
    """Completion of a read up from nvme: keep ``extent`` as ``entry``'s clean copy when the
    last read call asked for it, else free it (Note [clean reads]).

    Raises:
        nothing beyond ``SpillSpace.free``'s ValueError.
    """
    if entry.keep_extent:
        entry.kept = extent
    else:
        spill.free(extent)


def reuse_kept(entry: Any) -> Any:
    """The kept extent of ``entry`` to demote it into without a write, taken off the entry,
    or None (Note [clean reads]).

    Raises:
        nothing.
    """
    kept, entry.kept = entry.kept, None
    return kept


def drop_kept(entries: Iterable[Any], spill: Any) -> int:
    """Free every kept extent of ``entries`` (a write needs the room); return the bytes freed
    (Note [clean reads]).

    Raises:
        nothing beyond ``SpillSpace.free``'s ValueError.
    """
    freed = 0
    for entry in entries:
        if entry.kept is not None:
            freed += entry.kept.alloc_bytes
            spill.free(entry.kept)
            entry.kept = None
    return freed
