"""The in-flight move table of a :class:`~tiermem.store.store.TierStore`: every copy between
tiers that has started and whose completion has not been applied yet.

Moves are asynchronous. Each in-flight move is a ``_Move`` whose completion functions run under
the store lock, either when somebody needs the key (:meth:`MoveTable.settle`) or when the store
reaps finished moves at the start of an operation (:meth:`MoveTable.reap`). A move's completion
never needs the lock, so waiting on one while holding the lock cannot deadlock. A failed write
(disk full, I/O error) reverts the key to the tier it came from, which still holds its bytes:
nothing is lost.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tiermem.store.transfer import TransferFuture


@dataclass(eq=False)
class _Move:
    entry: Any  # the store's ``_Entry`` being moved; its ``move`` is this while in flight
    src: str | None
    dst: str
    future: TransferFuture
    on_done: Callable[[], None]
    on_fail: Callable[[BaseException], None]
    keep: list = field(default_factory=list)  # buffers that must outlive the copy
    started_s: float = 0.0  # perf_counter() at the start (set only with a recorder)


class MoveTable:
    """The moves in flight of one store, which owns this table (``TierStore._inflight``).

    Fields, all read and written only under the owning store's lock (``TierStore._lock``):

    - ``moves``: the in-flight ``_Move`` s, in start order; an entry's ``move`` is its own.
    - ``moved``: bytes moved per link (``"cpu->gpu"``, ...), reported by ``TierStore.stats``.
    - ``kept_bytes``: bytes demoted to nvme into a kept extent, with no write (Note [clean
      reads] in ``clean.py``), reported by ``TierStore.stats``.

    It reads the store (through a weak proxy: no reference cycle keeps a dropped store alive)
    for the recorder, the per-tier usage and the peaks (``TierStore._budgets.peak``, which
    :meth:`count` raises).
    """

    def __init__(self, store: Any) -> None:
        self._store = weakref.proxy(store)
        self.moves: list[_Move] = []
        self.moved: dict[str, int] = {}
        self.kept_bytes = 0  # evicted to nvme into a kept extent, unwritten (clean.py)

    @staticmethod
    def event_future(event: torch.cuda.Event | None) -> TransferFuture:
        """A future done when ``event`` has completed (at once for None: a CPU copy)."""
        future = TransferFuture()
        future._set_event(event)
        return future

    def start(self, entry, src, dst, future, keep=()):
        """Track a move whose completion needs no bookkeeping (a put's initial copy)."""
        self.add(entry, src, dst, future, lambda: None, lambda exc: None, keep=list(keep))

    def add(self, entry, src, dst, future, on_done, on_fail, keep=()):
        """Track ``entry``'s move ``src`` -> ``dst`` (``src`` None: a put's first copy, not
        counted as moved bytes); ``on_done``/``on_fail(exc)`` run when it is finished."""
        move = _Move(entry, src, dst, future, on_done, on_fail, list(keep))
        if self._store._recorder is not None:
            move.started_s = time.perf_counter()
        self.moves.append(move)
        entry.move = move
        if src is not None:
            self.count(src, dst, entry.nbytes)

    def count(self, src: str, dst: str, nbytes: int) -> None:
        """Count ``nbytes`` moved ``src`` -> ``dst`` and raise ``dst``'s peak usage."""
        name = f"{src}->{dst}"
        self.moved[name] = self.moved.get(name, 0) + nbytes
        peak = self._store._budgets.peak
        peak[dst] = max(peak[dst], self._store.used_bytes(dst))
        if self._store._recorder is not None:
            self._store._sample()

    def finish(self, move: _Move, wait: bool) -> bool:
        """Apply a finished move's completion (waiting if ``wait``). Return True if applied.

        Raises:
            Exception: a failed read (the data is not returned), after reverting the entry.
        """
        if not wait and not move.future.done():
            return False
        try:
            move.future.wait()  # its completion frees the source only after the copy landed
        except BaseException as exc:
            self.detach(move)
            move.on_fail(exc)
            if self._store._recorder is not None:
                self.record(move, ok=False)
            if move.src == "nvme" or move.src is None:
                raise
            return True
        self.detach(move)
        move.on_done()
        if self._store._recorder is not None:
            self.record(move, ok=True)
        return True

    def record(self, move: _Move, ok: bool) -> None:
        """Report a finished (applied) move and the memory after it to the recorder."""
        self._store._recorder.transfer(move.src or "put", move.dst, move.entry.key,
                                       move.entry.nbytes, move.started_s, time.perf_counter(),
                                       ok=ok)
        self._store._sample()

    def detach(self, move: _Move) -> None:
        """Take ``move`` off the table and off its entry."""
        self.moves.remove(move)
        if move.entry.move is move:
            move.entry.move = None

    def settle(self, entry: Any) -> None:
        """Wait for ``entry``'s move, if any, and apply it (re-raises a failed read)."""
        if entry.move is not None:
            self.finish(entry.move, wait=True)

    def reap(self) -> None:
        """Apply every move that has finished, waiting for none."""
        for move in list(self.moves):
            try:
                self.finish(move, wait=False)
            except Exception:  # a failed read stays recorded on its entry's tier; get re-raises
                pass
