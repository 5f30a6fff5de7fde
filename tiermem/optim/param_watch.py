"""Parameters changed by someone else than HybridAdam: detected by their version counters and
storage, and taken into the fp32 masters before they are stepped (Note [param changes]).

Note [param changes]: torch.optim.AdamW steps whatever the parameter holds at ``step()``, so an
in-place change (``p.fill_``, ``model.load_state_dict``, an EMA swap) or a new storage
(``p.data = t``, which ``module._apply`` and re-tying do) is simply continued from. HybridAdam
keeps masters apart from the parameter (offloaded chunks, fp32 masters of non-fp32 params) and
views of the parameter's storage (the GPU side), so it must notice. A streamed weight (Note
[streamed write-back]) is watched through its host copy; a replaced ``.data`` of it is copied
into the host copy through the parameter (``WeightStream.adopt``, its ``_version`` moves) when
HybridAdam checks it, so it is seen like an in-place change. Every HybridAdam write to a
parameter (the GPU side's step, the worker's H2D copies, the GPU lane's cast) runs inside
:meth:`ParamWatch.writing`, which adds the version bumps it made to the version the parameter
is expected to have; anything else that bumps it, or a different ``data_ptr``, is a change.
Before a parameter is stepped -- when its gradient is handed to the CPU side (the hook, with
overlap during backward, or ``step()``) and, for the rest, in ``step()`` before the GPU side
steps -- a change is taken into its masters: elementwise, the master is kept where it still
rounds to the parameter's value (``master.to(p.dtype) == p``: a reload of the same weights, the
model half of a checkpoint loaded after the optimizer half, leave bf16 masters' low bits
intact), and elsewhere replaced by the parameter upcast (exact). For fp32 parameters that is
the parameter itself, bit for bit, which is what AdamW continues from; for bf16/fp16 it is the
master AdamW with fp32 master weights would hold. A new storage is re-bound (the GPU side's
views and fp32 masters are taken from it); a new shape, dtype or device is refused.
Changes inside a step cannot be honoured once the CPU side may have stepped from the old value,
so they are refused loudly: with ``overlap=True`` a parameter changed after its gradient hook
and before ``step()`` (AdamW would step the new value; the chunk was stepped from the old one)
makes ``step()`` raise, and with ``param_sync="forward"`` an offloaded parameter changed while
the step was still pending (race with its H2D copy) makes the completion raise; call
``opt.synchronize()`` first. A change through ``param.data`` (a version counter of its own) is
seen by the bytes instead: Note [param checksums] (``param_sums.py``; a streamed weight's
too: Note [streamed write-back checksums]). One process only (``data_parallel`` and FSDP2 are
not watched).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from tiermem.optim.layout import StateLayout, local_view, state_views
from tiermem.optim.param_sums import ParamSums
from tiermem.stream.checksums import MASK_64, piece_checksum
from tiermem.stream.weights import stream_of


class ParamWatch:
    """Expected version and storage of every local tensor (one process), and the refresh of its
    masters when the parameter changed (Note [param changes]).

    Attributes:
        active: whether changes are watched (one process); else every call is a no-op.
    """

    def __init__(self, layout: StateLayout, who: str, active: bool) -> None:
        """Args: the optimizer's layout, its error prefix and whether to watch.

        Raises:
            Nothing.
        """
        self._layout = layout
        self._who = who
        self.active = active
        self._lock = threading.Lock()  # our writes and the checks: caller, hooks and worker
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}  # (g, i) -> (version, ptr)
        self._kind: dict[tuple[int, int], tuple] = {}  # (g, i) -> (shape, dtype, device)
        self._checked: set[tuple[int, int]] = set()  # synced this step
        self._sums = ParamSums(who)  # Note [param checksums]: changes through param.data
        self._steps: dict[tuple[int, int], int] = {}  # streamed (g, i) -> steps at its sum
        # streamed (g, i) -> {start: (elements, sum)} of the pieces the worker wrote this step
        self._pieces: dict[tuple[int, int], dict[int, tuple[int, int | None]]] = {}

    def _param(self, g: int, i: int) -> torch.Tensor:
        return self._layout.groups[g].params[i]

    def _sig(self, g: int, i: int) -> tuple[int, int]:
        p = self._param(g, i)  # a streamed weight's storage is its host copy's
        if i in self._layout.groups[g].host_copies and (s := stream_of(p)) is not None:
            s.adopt(p)  # a replaced .data becomes a version move of the host copy
        return p._version, local_view(self._layout.groups[g], i).data_ptr()

    def record_all(self) -> None:
        """The masters now match the parameters (state allocated or loaded): expect them as
        they are (caller's thread, worker idle).

        Raises:
            Nothing.
        """
        if not self.active:
            return
        with self._lock:
            for g in self._layout.groups:
                for i, p in enumerate(g.params):
                    self._seen[(g.index, i)] = self._sig(g.index, i)
                    self._kind[(g.index, i)] = _kind(g, i)
            self._streamed_steps()  # the sums below are of the host copies as they are
            self._sums.take(self._storages(), only_void=False)

    def _storages(self, only: tuple[int, int] | None = None,
                  known: bool = False) -> dict[tuple[int, int], torch.Tensor | int]:
        """The flat storage views of the watched parameters whose bytes are summed (Note
        [param checksums]; a streamed weight's: its host copy); with ``only``, that one's at
        most; with ``known``, a streamed weight's sum instead where its stream knows it
        without a read (Note [streamed write-back checksums])."""
        out: dict[tuple[int, int], torch.Tensor | int] = {}
        for g in self._layout.groups:
            for i in range(len(g.params)):
                key = (g.index, i)
                if (only is not None and only != key) or key not in self._seen:
                    continue
                s = stream_of(g.params[i]) if known and i in g.host_copies else None
                now = None if s is None else s.host_sum(g.params[i])
                out[key] = local_view(g, i) if now is None else now
        return out

    def _streamed_steps(self) -> list[tuple[int, int]]:
        """The streamed weights stepped since their sum was taken (the worker's kernel writes
        a host copy in place, outside :meth:`writing`: Note [in-place host chunks]); their
        step counts are noted as seen."""
        out = []
        for g in self._layout.groups:
            for i in g.host_copies:
                if self._steps.get((g.index, i), 0) != g.steps[i]:
                    self._steps[(g.index, i)] = g.steps[i]
                    out.append((g.index, i))
        return out

    def begin_step(self) -> None:
        """A new step: every parameter is checked again before it is stepped; the sums of
        those HybridAdam wrote are retaken (Note [param checksums]: called once the last step's
        writes are issued on the caller's stream).

        Raises:
            Nothing beyond torch's errors.
        """
        with self._lock:
            self._checked.clear()
            pieces, self._pieces = self._pieces, {}
            if self.active:
                self._sums.written(self._streamed_steps())  # in place: no writing() block
                self._sums.take(self._storages(), only_void=True, known=self._tiled(pieces))

    def pieces_written(self, g: int, pieces: Iterable[tuple[int, int, int]],
                       known: dict[tuple[int, int], int | None] | None = None) -> None:
        """The chunk worker has written these pieces ``(local tensor, start, elements)`` of
        group ``g`` (its thread): for those of streamed weights, take the sums of what it
        wrote, so the next step's sum of the host copy needs no read (Note [streamed
        write-back checksums]): ``known`` (``(local tensor, start)`` -> sum) has those the CPU
        kernel summed as it wrote them (in place); the others are summed now, while at hand.

        Raises:
            Nothing beyond torch's errors.
        """
        group = self._layout.groups[g]
        if not self.active or not group.host_copies:
            return
        known = known or {}
        sums = [((g, i), start, numel, known[(i, start)] if (i, start) in known
                 else piece_checksum(local_view(group, i), start, numel))
                for i, start, numel in pieces if i in group.host_copies]
        with self._lock:
            for key, start, numel, s in sums:
                self._pieces.setdefault(key, {})[start] = (numel, s)  # a rewrite replaces

    def _tiled(self, pieces: dict[tuple[int, int], dict[int, tuple[int, int | None]]]
               ) -> dict[tuple[int, int], int]:
        """The sums of the weights whose pieces written this step tile them exactly (else
        they are read: a GPU-side or lane piece, a misaligned host copy)."""
        out = {}
        for (g, i), parts in pieces.items():
            at, total = 0, 0
            for start in sorted(parts):
                numel, s = parts[start]
                if start != at or s is None:
                    break
                at, total = at + numel, total + s
            else:
                if at == local_view(self._layout.groups[g], i).numel():
                    out[(g, i)] = total & MASK_64
        return out

    @contextmanager
    def writing(self, items: Iterable[tuple[int, int]]) -> Iterator[None]:
        """HybridAdam writes local tensors ``items`` inside this block: their version bumps are
        expected (any thread; serialised with the other writers and the checks).

        Raises:
            Nothing of its own.
        """
        if not self.active:
            yield
            return
        items = list(dict.fromkeys(items))
        with self._lock:
            before = [self._param(g, i)._version for g, i in items]
            yield
            for (g, i), version in zip(items, before):
                seen = self._seen.get((g, i))
                if seen is not None:
                    self._seen[(g, i)] = (seen[0] + self._param(g, i)._version - version,
                                          seen[1])
            self._sums.written(items)  # Note [param checksums]: retaken at the next step

    def changed(self, g: int, i: int) -> bool:
        """Whether local tensor ``i`` of group ``g`` changed since HybridAdam last wrote it.

        Raises:
            Nothing.
        """
        if not self.active:
            return False
        with self._lock:
            return self._seen.get((g, i), self._sig(g, i)) != self._sig(g, i)

    def checked(self, g: int, i: int) -> bool:
        """Whether local tensor ``i`` of group ``g`` was synced this step.

        Raises:
            Nothing.
        """
        with self._lock:
            return (g, i) in self._checked

    def sync(self, g: int, i: int, mark: bool = True) -> None:
        """Before local tensor ``i`` of group ``g`` is stepped: take a change into its masters
        (Note [param changes]); once per step with ``mark``. No chunk of it may be in the
        worker's hands.

        Raises:
            ValueError: the parameter now has another shape, dtype or device.
            StoreClosedError: the store was closed.
        """
        if not self.active:
            return
        with self._lock:
            if (g, i) in self._checked:
                return
            if mark:
                self._checked.add((g, i))
            seen = self._seen.get((g, i))
            now = self._sig(g, i)
            if seen is None or (seen == now and not self._sums.moved(  # Note [param checksums]
                    (g, i), lambda: self._storages(None if mark else (g, i), known=True),
                    batch=mark)):
                return
        self._refresh(g, i, rebind=seen[1] != now[1])
        with self._lock:
            self._seen[(g, i)] = now

    def _refresh(self, gi: int, i: int, rebind: bool) -> None:
        """Take local tensor ``i``'s values into its GPU-side and offloaded masters; with
        ``rebind``, first re-take the GPU side's views of its new storage."""
        layout = self._layout
        g = layout.groups[gi]
        kind = _kind(g, i)
        if kind != self._kind[(gi, i)]:
            shape, dtype, device = self._kind[(gi, i)]
            raise ValueError(f"{self._who}: param {i} of param group {gi} is now {kind[1]} of "
                             f"shape {kind[0]} on {kind[2]}, but its optimizer state is laid "
                             f"out for {dtype} of shape {shape} on {device}; make a new "
                             f"HybridAdam after changing a parameter's shape, dtype or device")
        local = local_view(g, i)
        for k, pc in enumerate(g.plan.gpu_pieces):
            if pc.param != i:
                continue
            view = local[pc.start:pc.start + pc.numel]
            if rebind:
                if g.gpu_masters[k] is g.gpu_views[k]:
                    g.gpu_masters[k] = view  # fp32: the parameter is its own master
                g.gpu_views[k] = view
            if g.gpu_masters[k] is not g.gpu_views[k]:
                _take(g.gpu_masters[k], view)
        store = layout.store
        for c in dict.fromkeys(g.plan.chunks_of_param.get(i, ())):
            chunk = g.plan.chunks[c]
            key = g.chunk_keys[c]
            on_nvme = store.tier_of(key) == "nvme"  # else it stays where it is (read ahead)
            blob = store.get(key, "cpu", hold=True)
            try:
                master = state_views(blob, chunk.numel, layout.moments_dtype)[0]
                for pc in chunk.pieces:
                    if pc.param == i:
                        rel = pc.flat_offset - chunk.flat_start
                        _take(master[rel:rel + pc.numel], local[pc.start:pc.start + pc.numel])
            finally:
                store.release(key)
            if on_nvme:
                store.evict(key, "nvme").wait()


def _kind(g, i: int) -> tuple:
    """(shape, dtype, device) of local tensor ``i`` of group ``g``: a streamed weight's are its
    host copy's (Note [streamed write-back]), whatever its ``.data`` is during a pass."""
    t = g.host_copies.get(i)
    t = g.params[i] if t is None else t
    return tuple(t.shape), t.dtype, t.device


def _take(master: torch.Tensor, param: torch.Tensor) -> None:
    """``master`` (fp32) becomes ``param`` upcast wherever it does not round to ``param``
    (Note [param changes])."""
    value = param.to(master.device)
    if param.dtype == torch.float32:
        master.copy_(value)
        return
    keep = master.to(param.dtype) == value
    master.copy_(torch.where(keep, master, value.float()))
