"""Double buffering of activation reloads (Note [offload rules], rule 6, in
tiermem/offload/rules.py): two persistent device buffer sets that the reloads of
consecutive groups alternate between, instead of fresh allocations.

A set is loaded on its own H2D stream, which first waits for the compute stream (the set's
previous readers were queued before backward entered this layer); a reader's stream waits for
the load's event before it reads a set (:meth:`DoubleBuffer.view`). Units: bytes.

A set whose memory is still referenced outside it when its next load comes (a reloaded tensor
kept beyond its layer) gets new memory instead of being overwritten: Note [handed-out reloads]
in tiermem/offload/activations.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from tiermem.offload.records import _Record
from tiermem.store import TierStore


ALIGN_BYTES = 512  # offsets of records inside a set (any dtype view is aligned)

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _referenced_elsewhere(buf: torch.Tensor) -> bool:
    """True if a tensor other than ``buf`` still refers to its memory (a view handed out by
    :meth:`DoubleBuffer.view` and kept: Note [handed-out reloads]). Without torch's count it
    says True: a new buffer is always correct."""
    if _use_count is None:
        return True
    storage = buf.untyped_storage()
    return _use_count(storage._cdata) > 2  # buf's own reference and the Python storage's


@dataclass
class _BufferSet:
    buf: torch.Tensor | None = None
    generation: int = 0  # bumped on every load, so stale slots are detected
    event: Any = None  # H2D event of the current load (CUDA)
    holds: list = field(default_factory=list)  # (key) the load reads from, released when done


class DoubleBuffer:
    """Two persistent device buffer sets that reloads of consecutive groups alternate between."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.sets = [_BufferSet(), _BufferSet()]
        self.next_set = 0
        self.loads = 0
        self.fallbacks = 0
        self.replaced = 0  # loads that found their set's memory still referenced elsewhere

    def capacity_bytes(self) -> int:
        return sum(s.buf.numel() for s in self.sets if s.buf is not None)

    def load(self, records: list[_Record], store: TierStore) -> list:
        """Copy ``records`` (their keys held in the store's host tier) into the next set.

        Returns the keys held for the copy; release them with :meth:`release_done`.
        """
        index = self.next_set
        self.next_set ^= 1
        bset = self.sets[index]
        self.release_set(bset, store, wait=True)
        offsets, total = [], 0
        for rec in records:
            offsets.append(total)
            total += -(-rec.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if bset.buf is not None and _referenced_elsewhere(bset.buf):
            # Note [handed-out reloads]: its holder keeps the old memory; the set takes new
            self.replaced += 1
            bset.buf = None
        if bset.buf is None or bset.buf.numel() < total:
            bset.buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        bset.generation += 1
        hosts = [store.get(rec.key, tier="cpu", hold=True) for rec in records]
        bset.holds = [rec.key for rec in records]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            # the set's previous readers (queued before backward entered this layer) finish first
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                for rec, off, host in zip(records, offsets, hosts):
                    bset.buf[off:off + rec.nbytes].copy_(host.reshape(-1).view(torch.uint8),
                                                         non_blocking=True)
                bset.event = torch.cuda.Event()
                bset.event.record(self.stream)  # readers wait on it; host blocks may be freed after
            bset.buf.record_stream(self.stream)  # a regrown set's old memory: written on this stream
        else:
            for rec, off, host in zip(records, offsets, hosts):
                bset.buf[off:off + rec.nbytes].copy_(host.reshape(-1).view(torch.uint8))
            self.release_set(bset, store, wait=False)
        for rec, off in zip(records, offsets):
            rec.slot = (index, bset.generation, off)
        self.loads += 1
        return bset.holds

    def view(self, rec: _Record) -> torch.Tensor | None:
        """The record's bytes in its set, or None if the set was reused since its load."""
        if rec.slot is None:
            return None
        index, generation, off = rec.slot
        bset = self.sets[index]
        if bset.generation != generation:
            rec.slot = None
            self.fallbacks += 1
            return None
        if bset.event is not None:
            torch.cuda.current_stream(self.device).wait_event(bset.event)  # the load has landed
        return bset.buf[off:off + rec.nbytes]

    def release_set(self, bset: _BufferSet, store: TierStore, wait: bool) -> None:
        """Release the store holds of ``bset``'s load once its copy has finished."""
        if not bset.holds:
            return
        if bset.event is not None:
            if not bset.event.query():
                if not wait:
                    return
                bset.event.synchronize()  # host blocks are reused only after the copy read them
        for key in bset.holds:
            try:
                store.release(key)
            except (KeyError, ValueError):  # already deleted with its last handle
                pass
        bset.holds = []

    def release_key(self, key: Hashable, store: TierStore) -> None:
        """Release the hold on ``key`` (before deleting it), waiting for its copy if needed."""
        for bset in self.sets:
            if key in bset.holds:
                if bset.event is not None and not bset.event.query():
                    bset.event.synchronize()  # the H2D still reads this key's host block
                store.release(key)
                bset.holds.remove(key)

    def close(self, store: TierStore, keep_buffers: bool) -> None:
        """Release every store hold (waiting for the loads); free the sets unless kept."""
        for bset in self.sets:
            self.release_set(bset, store, wait=True)
            if not keep_buffers:
                bset.buf = None
