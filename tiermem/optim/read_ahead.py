"""NVMe read-ahead of HybridAdam's chunk stream: the first chunks of a step are read behind its
forward, and each chunk stepped (on the CPU or the GPU lane) starts reading the next ones, at
most ``nvme_lookahead_chunks`` in RAM ahead of the step.
"""

from __future__ import annotations

import itertools

from tiermem.optim.layout import StateLayout
from tiermem.optim.step_state import StepState


class ReadAhead:
    """Prefetches NVMe-resident chunks into the store's cpu tier ahead of the step."""

    def __init__(self, layout: StateLayout, step: StepState) -> None:
        """Args: the optimizer's state layout and its step state (``read_ahead`` is kept there).

        Raises:
            Nothing.
        """
        self._layout = layout
        self._step = step
        self._order_pos = None  # (expected chunk order, position of each chunk in it)

    def plan_changed(self) -> None:
        """Forget the indexed chunk order: the plan or the tiers changed (caller's thread).

        Raises:
            Nothing.
        """
        self._order_pos = None

    def first_chunks(self) -> None:
        """Start reading the first NVMe chunks of the next step (hidden behind its forward).

        Raises:
            StoreClosedError: the store was closed.
        """
        layout = self._layout
        if layout.nvme_chunks:
            first = layout.nvme_order()[:layout.nvme_lookahead_chunks]
            with self._step.lock:
                self._step.read_ahead = set(first)
            for g, c in first:
                layout.store.prefetch(layout.groups[g].chunk_keys[c], "cpu")

    def after(self, g: int, c: int) -> None:
        """Chunk ``c`` of group ``g`` is being stepped: prefetch the NVMe chunks stepped after
        it, up to ``nvme_lookahead_chunks`` in RAM (worker thread).

        Raises:
            StoreClosedError: the store was closed.
        """
        layout = self._layout
        if not layout.nvme_chunks:
            return
        if self._order_pos is None:  # the plan and the tiers are fixed: index the order once
            order = layout.expected_order()
            self._order_pos = (order, {item: k for k, item in enumerate(order)})
        order, pos = self._order_pos
        step = self._step
        with step.lock:  # chunks whose gradients came early were stepped already
            step.read_ahead.discard((g, c))
            room = layout.nvme_lookahead_chunks - len(step.read_ahead)  # bounded: never evicted
            later = list(itertools.islice(
                (item for item in itertools.islice(order, pos[(g, c)] + 1, None)
                 if item in layout.nvme_chunks and item not in step.queued
                 and item not in step.read_ahead), max(0, room)))
            step.read_ahead.update(later)
        for gg, cc in later:
            layout.store.prefetch(layout.groups[gg].chunk_keys[cc], "cpu")
