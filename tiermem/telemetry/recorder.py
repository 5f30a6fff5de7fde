"""Telemetry of a TierStore: per-tier bytes over time, every move with start/end, stalls in get.

``store = TierStore(cfg, recorder=Recorder())`` (or ``store.recorder = Recorder()``); the store
reports to it under its lock, and a store without a recorder pays one ``if`` per event. Times
are ``time.perf_counter()`` seconds; exports convert them to offsets from the recorder's start.

What is recorded:

* memory: every tier's used bytes (in-flight reservations included), sampled after every change
  the store makes (move start, move completion, put, delete); consecutive equal samples are kept
  once.
* transfers: one record per store move (a copy, a spill write or read, or a chain like
  nvme -> cpu -> gpu), with its source and destination tier, key, bytes and two host-clock
  times: when the store *issued* the move and when it *observed* the move complete (it reaps
  finished moves at its next operation, or waits for one it needs). That span is an
  issue-to-observed-completion time, not the copy's duration: the copy may have waited behind
  other work on its stream and may have finished long before the store looked, so bytes divided
  by the span is not a link rate (to time copies, use CUDA events, as
  :func:`tiermem.schedule.layers.copy_bandwidths` does). ``src`` is ``"put"`` for a ``put``'s
  own copy. The stream names are those of the links: ``cpu->gpu`` is H2D, ``gpu->cpu`` D2H,
  ``cpu->nvme`` a spill write, ``nvme->*`` a read.
* stalls: each ``get`` that moved its key or waited for a move: key, the tier it came from, and
  the seconds the caller was blocked.
* steps: ``TierStore.mark_step()`` times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from tiermem.config import TIERS

STREAMS = {"cpu->gpu": "H2D", "put->gpu": "H2D", "gpu->cpu": "D2H", "put->cpu": "D2H",
           "cpu->nvme": "NVMe write", "put->nvme": "NVMe write", "nvme->cpu": "NVMe read",
           "nvme->gpu": "NVMe read"}
"""Stream / link name of each move direction (``src->dst``)."""


@dataclass(frozen=True)
class Transfer:
    """One store move, timed on the host from issue to observed completion.

    Attributes:
        src: source tier (``"put"``: a put's own copy).
        dst: destination tier.
        key: the store key (its ``repr`` in exports).
        nbytes: bytes moved.
        start_s: ``perf_counter`` seconds when the store issued the move.
        end_s: ``perf_counter`` seconds when the store observed it complete (applied its
            completion at its next operation or while waiting for it); the copy itself may
            have ended earlier.
        ok: False if the move failed (the key stayed where it was).
    """

    src: str
    dst: str
    key: Hashable
    nbytes: int
    start_s: float
    end_s: float
    ok: bool = True

    @property
    def direction(self) -> str:
        """``"src->dst"``."""
        return f"{self.src}->{self.dst}"

    @property
    def issue_to_observed_s(self) -> float:
        """Seconds from issue to observed completion (see the class docstring): an upper bound
        on the copy's own duration, so ``nbytes / issue_to_observed_s`` is no link rate."""
        return max(0.0, self.end_s - self.start_s)

    @property
    def stream(self) -> str:
        """The link it used: ``"H2D"``, ``"D2H"``, ``"NVMe read"`` or ``"NVMe write"``."""
        return STREAMS.get(self.direction, self.direction)


@dataclass(frozen=True)
class Stall:
    """One ``get`` that blocked: ``key``, the tier it came from, start/end ``perf_counter`` s."""

    key: Hashable
    tier: str
    start_s: float
    end_s: float


class Recorder:
    """Collects a store's telemetry; export with :meth:`to_chrome_trace` / :meth:`plot_memory`.

    Args:
        max_events: records kept per kind (memory samples, transfers, stalls); older ones are
            dropped first, counted in ``dropped``.

    Raises:
        ValueError: ``max_events`` < 1.
    """

    def __init__(self, max_events: int = 1_000_000) -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"Recorder: max_events={max_events!r} must be an int >= 1")
        self.max_events = max_events
        self.start_s = time.perf_counter()
        """``perf_counter`` seconds at creation: time 0 of the exports."""
        self.budgets: dict[str, int] = {}
        """Byte budget per tier of the attached store."""
        self.samples: list[tuple[float, dict[str, int]]] = []
        """``(perf_counter s, {tier: used bytes})`` after every change."""
        self.transfers: list[Transfer] = []
        self.stalls: list[Stall] = []
        self.steps: list[float] = []
        """``perf_counter`` seconds of each ``mark_step``."""
        self.dropped = 0
        self._store: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ called by the store

    def attach(self, store: Any) -> None:
        """Take the store's budgets and its current usage (the store calls it).

        Raises:
            ValueError: already attached to another store.
        """
        if self._store is not None and self._store is not store:
            raise ValueError("Recorder: already attached to another TierStore; use one Recorder "
                             "per store")
        self._store = store
        self.budgets = {t: store.config.budget(t) for t in TIERS}
        self.memory({t: store.used_bytes(t) for t in TIERS})

    def memory(self, used: dict[str, int]) -> None:
        """Record every tier's used bytes now (kept only if it changed)."""
        with self._lock:
            if self.samples and self.samples[-1][1] == used:
                return
            self._append(self.samples, (time.perf_counter(), dict(used)))

    def transfer(self, src: str, dst: str, key: Hashable, nbytes: int, start_s: float,
                 end_s: float, ok: bool = True) -> None:
        """Record one finished move (times in ``perf_counter`` seconds)."""
        with self._lock:
            self._append(self.transfers, Transfer(src, dst, key, nbytes, start_s, end_s, ok))

    def stall(self, key: Hashable, tier: str, start_s: float, end_s: float) -> None:
        """Record a ``get`` of ``key`` (coming from ``tier``) that blocked its caller."""
        with self._lock:
            self._append(self.stalls, Stall(key, tier, start_s, end_s))

    def mark_step(self) -> None:
        """Record a step boundary now."""
        with self._lock:
            self._append(self.steps, time.perf_counter())

    def _append(self, items: list, item: Any) -> None:
        if len(items) >= self.max_events:
            del items[: max(1, self.max_events // 10)]
            self.dropped += 1
        items.append(item)

    # ------------------------------------------------------------------ summaries

    def peak_bytes(self) -> dict[str, int]:
        """Return the largest used bytes seen per tier."""
        with self._lock:
            return {t: max((u.get(t, 0) for _, u in self.samples), default=0) for t in TIERS}

    def stall_s(self) -> float:
        """Return the total seconds callers blocked in ``get``."""
        with self._lock:
            return sum(s.end_s - s.start_s for s in self.stalls)

    def bytes_by_direction(self) -> dict[str, int]:
        """Return the bytes of successful moves per direction (``"cpu->gpu"``, ...)."""
        out: dict[str, int] = {}
        with self._lock:
            for t in self.transfers:
                if t.ok:
                    out[t.direction] = out.get(t.direction, 0) + t.nbytes
        return out

    def summary(self) -> dict:
        """Return ``{"peak_bytes": {tier: n}, "stall_s": s, "moved_bytes": {dir: n},
        "transfers": n, "steps": n}``."""
        return {"peak_bytes": self.peak_bytes(), "stall_s": self.stall_s(),
                "moved_bytes": self.bytes_by_direction(), "transfers": len(self.transfers),
                "steps": len(self.steps)}

    def snapshot(self) -> tuple[list, list, list, list]:
        """Return copies of ``(samples, transfers, stalls, steps)`` taken under the lock."""
        with self._lock:
            return list(self.samples), list(self.transfers), list(self.stalls), list(self.steps)

    # ------------------------------------------------------------------ exports

    def to_chrome_trace(self, path: str) -> dict:
        """Write a Chrome trace JSON file (opens in Perfetto / chrome://tracing); return it.

        See :func:`tiermem.telemetry.chrome.to_chrome_trace`.

        Raises:
            OSError: the file cannot be written.
        """
        from tiermem.telemetry.chrome import to_chrome_trace

        return to_chrome_trace(self, path)

    def plot_memory(self, path: str) -> None:
        """Write a PNG of the memory timeline per tier with transfers marked.

        See :func:`tiermem.telemetry.plot.plot_memory`.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'tiermem[plot]'``).
            OSError: the file cannot be written.
        """
        from tiermem.telemetry.plot import plot_memory

        plot_memory(self, path)
