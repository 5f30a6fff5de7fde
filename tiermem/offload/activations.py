"""Activation offload: saved tensors of chosen layers go through a TierStore, back in reverse order.

``offload_activations(model.blocks)`` is a context manager over
:class:`torch.autograd.graph.saved_tensors_hooks` that knows the layer boundaries (forward
pre-hooks on each block). Tensors autograd saves inside an offloaded layer are put into the store
(``"cpu"``: pinned host memory; ``"nvme"``: spill files) and their device memory is released as
soon as the forward drops them and the D2H copy has finished. In backward they come back in
reverse layer order: when backward first needs layer ``i`` it prefetches layers ``i-1 ...
i-prefetch_depth``.

This module holds the hooks (:class:`ActivationOffloader`) and :func:`offload_activations`.
The rules they follow are Note [offload rules] in tiermem/offload/rules.py, beside
:class:`LayerPolicy` and the argument checks; around them: calibration.py (``layers="auto"``,
Note [timed forward]), records.py (a record per offloaded storage, a handle per saved tensor),
double_buffer.py (rule 6), versions.py (rule 12), marks.py (``mark_for_offload``), context.py
(the context active on each thread), defaults.py (the private store's config).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Hashable

import torch
from torch import nn

from tiermem import options
from tiermem._graphs import refuse_capture
from tiermem.offload.calibration import (_CALIBRATION_FORWARD, _TIMING_TRIES, _Calibration,
                                         copy_rates, plan_layers)
from tiermem.offload.context import _ACTIVE, _in_backward, active_offloader
from tiermem.offload.defaults import available_host_bytes, default_store_config
from tiermem.offload.double_buffer import DoubleBuffer
from tiermem.offload.marks import MARK, _is_marked, mark_storage
from tiermem.offload.records import _Record, _Saved
from tiermem.offload.rules import LayerPolicy, check_arguments, resolve_layers
from tiermem.offload.versions import BACKWARD, Kept, check_version, version_tracker
from tiermem.store import TierFullError, TierStore

_D = options.defaults("activations", "api")
"""The arguments' defaults, from the one definition (Note [one definition] in
tiermem/options.py)."""

__all__ = ["ActivationOffloader", "offload_activations", "LayerPolicy", "resolve_layers",
           "default_store_config", "available_host_bytes", "active_offloader", "mark_storage",
           "MARK"]


class ActivationOffloader:
    """Hook state of :func:`offload_activations` (a context manager; see Note [offload rules]).

    Use :func:`offload_activations` to make one; the arguments are documented there. One
    object can be entered again after it exited (e.g. once per training step).
    """

    _uids = itertools.count()
    _regions_only: ClassVar[bool] = False  # tiermem.offload.tensors.TensorOffloader: no blocks

    def __init__(self, blocks: Sequence[nn.Module], *, store: TierStore | None = None,
                 tier: str = _D["tier"], num_layers: int | None = _D["num_layers"],
                 layers: Iterable[int] | str | None = None,
                 prefetch_depth: int = _D["prefetch_depth"],
                 min_offload_bytes: int = _D["min_offload_bytes"],
                 offload_weights: bool = _D["offload_weights"],
                 double_buffering: bool = _D["double_buffering"],
                 max_kept_bytes: int | None = _D["max_kept_bytes"]) -> None:
        blocks, auto = check_arguments(blocks, store, tier, num_layers, layers, prefetch_depth,
                                       min_offload_bytes, offload_weights, double_buffering,
                                       max_kept_bytes, self._regions_only)
        self.blocks = blocks
        self.tier = tier
        self.double_buffering = bool(double_buffering)
        # layers="auto": all but the last until the calibration forward has been timed
        self.policy = LayerPolicy(len(blocks),
                                  resolve_layers(len(blocks), num_layers,
                                                 None if auto else layers),
                                  min_offload_bytes, bool(offload_weights), prefetch_depth)
        self.max_kept_bytes = max_kept_bytes
        self.plan: dict | None = None
        """With ``layers="auto"``: the choice and what it was made from, once made (see
        :meth:`_plan_layers`); None before (or with explicit layers)."""
        self._calibration: _Calibration | None = _Calibration(len(blocks)) if auto else None
        self._timed_fwd = _CALIBRATION_FORWARD  # the forward being timed (Note [timed forward])
        self._timing_tries = 0  # timed forwards that did not time every block
        self._own_store = store is None
        self._store = store
        self._uid = next(self._uids)
        self._lock = threading.RLock()  # pack (forward thread), unpack/release (autograd threads)
        self._seq = itertools.count()
        self._hooks: list = []
        self._saved_hooks: Any = None
        self._entered = False
        self._thread: int | None = None  # the thread that entered (its forwards' block hooks)
        self._closing = False
        self._weight_ptrs: set[int] = set()
        # forward state
        self._fwd = 0
        self._fresh = True
        self._last_block = -1
        self._current: int | None = None
        self._pending: list[weakref.ref] = []
        # the timed forward's handles, offloaded at their block's exit (Note [timed forward])
        self._deferred: list[tuple[weakref.ref, Hashable]] = []
        # open regions' groups, innermost last (Note [offload rules], rule 10)
        self._regions: list[Hashable] = []
        self._region_seq = itertools.count()
        self._blocks_run = 0  # block pre-hooks run since entry (Note [offload rules], rule 9)
        self._blocks_no_grad = 0  # block pre-hooks run under no_grad since entry (rule 9)
        self._unassigned = 0  # candidates saved outside every block since entry
        # records
        self._by_storage: dict[tuple, _Record] = {}
        self._groups: dict[Hashable, list[_Record]] = {}
        self._records = 0
        # backward state
        self._graph_task = None
        self._entered_groups: set = set()
        self._buffers: DoubleBuffer | None = None
        self.counters = dict.fromkeys(
            ("packed", "offloaded", "deduplicated", "kept", "put_bytes", "reloads", "prefetches",
             "store_full", "gpu_full"), 0)
        """Event counts (``put_bytes`` in bytes), for tests and benchmarks."""

    # ------------------------------------------------------------------ context manager

    @property
    def store(self) -> TierStore | None:
        """The store activations go through (a private one is made on first entry)."""
        return self._store

    @property
    def live_keys(self) -> int:
        """Number of store keys this offloader holds now."""
        return self._records

    def __enter__(self) -> "ActivationOffloader":
        if active_offloader() is not None:
            raise RuntimeError("offload_activations: another offload context is active; nested "
                               "use is not supported: exit it first, or give one context all "
                               "blocks (layers=[...] picks which are offloaded)")
        if self._entered:
            raise RuntimeError("offload_activations: this context is already entered on another "
                               "thread; give each thread its own offload_activations(...)")
        if self._own_store and (self._store is None or self._store.closed):
            self._store = TierStore(default_store_config())
            # one private store for the offloader's life: pinned memory is allocated once, not
            # every step; closed by close() or when the offloader is dropped
            weakref.finalize(self, self._store.close)
        if self.double_buffering and (self._buffers is None or
                                      self._buffers.device != self._store.device):
            self._buffers = DoubleBuffer(self._store.device)
        self._closing = False
        self._weight_ptrs = {t.untyped_storage().data_ptr() for b in self.blocks
                             for t in itertools.chain(b.parameters(), b.buffers())}
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._make_enter_hook(i)))
            self._hooks.append(block.register_forward_hook(self._make_exit_hook(i),
                                                           always_call=True))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(
            torch.compiler.disable(self._pack), torch.compiler.disable(self._unpack))
        self._saved_hooks.__enter__()
        self._fresh = True
        self._current = None
        self._blocks_run = 0
        self._blocks_no_grad = 0
        self._unassigned = 0
        _ACTIVE.offloader = self
        self._thread = threading.get_ident()
        self._entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            return
        self._saved_hooks.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        _ACTIVE.offloader = None
        self._entered = False
        with self._lock:
            self._pending.clear()  # tensors saved after the last block stay where they are
            self._deferred.clear()  # a block whose exit never ran keeps them on the device
            self._closing = True
            self._maybe_close()
            silent = self._unassigned and not self._blocks_run and self.policy.layers
        if silent and exc[0] is None and self._blocks_no_grad:  # Note [offload rules], rule 9
            raise RuntimeError(
                f"offload_activations: the forward saved {self._unassigned} tensors outside "
                f"every block, and the blocks ran only under torch.no_grad(), so nothing was "
                f"offloaded: torch.utils.checkpoint(block, ..., use_reentrant=True) runs them so "
                f"(transformers' gradient_checkpointing_enable() too, unless given "
                f"{{'use_reentrant': False}}); pass use_reentrant=False, which offloads each "
                f"checkpointed block's input with it")
        if silent and exc[0] is None:  # Note [offload rules], rule 9
            raise RuntimeError(
                f"offload_activations: the forward saved {self._unassigned} tensors but none of "
                f"the {len(self.blocks)} blocks' forward hooks ran, so nothing was offloaded; "
                f"pass the modules the forward actually calls (e.g. model.blocks), and with "
                f"torch.compile compile the blocks (block.compile()) or the model after "
                f"entering, not a model whose hooks were traced away")

    def _maybe_close(self) -> None:
        """Once no key is left after exit (backward may run after the ``with``): release the
        double buffer's store holds. The buffer sets and a private store persist across steps
        (its pinned blocks are reused, as a caller's are) until :meth:`close` or until the
        offloader is garbage-collected."""
        if not (self._closing and self._records == 0):
            return
        if self._buffers is not None:
            self._buffers.close(self._store, keep_buffers=True)

    def close(self) -> None:
        """Free the double-buffer sets and close a private store (waits for nothing else).

        Raises:
            RuntimeError: the context is active or keys are still live (a graph not yet run
                backward).
        """
        if self._entered or self._records:
            raise RuntimeError(f"offload_activations.close(): {self._records} keys are live or "
                               f"the context is active; run backward (or drop the graph) and "
                               f"exit first")
        if self._buffers is not None:
            self._buffers.close(self._store, keep_buffers=False)
        if self._own_store and self._store is not None:
            self._store.close()

    # ------------------------------------------------------------------ layer boundaries

    def _make_enter_hook(self, index: int):
        @torch.compiler.disable  # Note [offload rules], rule 9: runs eagerly, never traced
        def hook(module, args):
            self._on_block_enter(index)
        return hook

    def _make_exit_hook(self, index: int):
        @torch.compiler.disable  # Note [offload rules], rule 9: runs eagerly, never traced
        def hook(module, args, output):
            self._on_block_exit(index)
        return hook

    def _on_block_enter(self, index: int) -> None:
        if _in_backward() or not self._own_thread():
            return  # checkpoint recomputation and other threads' forwards change no state
        if not torch.is_grad_enabled():
            self._blocks_no_grad += 1  # eval forwards (and a reentrant checkpoint's: rule 9)
            return
        with self._lock:
            self._offload_deferred()  # an enclosing block's, or one whose exit hook never ran
            if self._fresh or index <= self._last_block:
                self._fwd += 1
                self._fresh = False
                cal = self._calibration
                if cal is not None and self._fwd > self._timed_fwd:
                    if cal.complete():
                        self._plan_layers()
                    else:  # the timed forward raised or skipped blocks (Note [timed forward])
                        self._time_again(cal)
            self._last_block = index
            self._current = index
            self._blocks_run += 1
            pending, self._pending = self._pending, []
            if self._calibrating():
                if self._calibration.bandwidths is None:  # before the timed blocks run
                    self._calibration.bandwidths = self._copy_rates()
                self._calibration.enter(index, self._store.device)
                for ref in pending:
                    handle = ref()
                    if handle is not None and handle.tensor is not None:
                        self._calibration.saved(index, handle.tensor)
            layer_offloaded = self.policy.offloads_layer(index)
            for ref in pending:
                handle = ref()
                if handle is not None and handle.tensor is not None \
                        and handle.tensor._version == handle.version \
                        and (layer_offloaded or handle.marked):
                    if self._calibrating():  # Note [timed forward]
                        self._deferred.append((ref, (self._fwd, index)))
                    else:
                        self._offload(handle, (self._fwd, index))

    def _on_block_exit(self, index: int) -> None:
        if not torch.is_grad_enabled() or _in_backward() or not self._own_thread():
            return
        with self._lock:
            self._current = None
            if self._calibrating():
                self._calibration.exit(index, self._store.device)  # before the deferred offloads
                if self._deferred:
                    t0 = time.perf_counter()
                    self._offload_deferred()
                    self._calibration.offload_host_s[index] = time.perf_counter() - t0

    def _own_thread(self) -> bool:
        """True on the thread that entered: another thread's forward of the same blocks is not
        this context's (its saved tensors do not reach these hooks)."""
        return threading.get_ident() == self._thread

    def _offload_deferred(self) -> None:
        """Offload the timed forward's handles held back until their block ended (Note [timed
        forward]); a tensor modified in place since it was saved stays on the device, as a
        pending one does."""
        deferred, self._deferred = self._deferred, []
        for ref, group in deferred:
            handle = ref()
            if handle is not None and handle.tensor is not None \
                    and handle.tensor._version == handle.version:
                self._offload(handle, group)

    # ------------------------------------------------------------------ layers="auto"

    def _calibrating(self) -> bool:
        return self._calibration is not None and self._fwd == self._timed_fwd

    def _time_again(self, cal: _Calibration) -> None:
        """The timed forward ended without timing every block (it raised, or did not run
        them all): time the forward starting now instead, at most ``_TIMING_TRIES`` times;
        then keep offloading all blocks but the last, with a warning (Note [timed forward])."""
        self._timing_tries += 1
        if self._timing_tries >= _TIMING_TRIES:
            self._calibration = None
            untimed = [i for i in range(len(self.blocks)) if i not in cal.marks
                       or cal.marks[i][1] is None]
            warnings.warn(f"offload_activations(layers='auto'): {_TIMING_TRIES} timed forwards "
                          f"did not run blocks {untimed} to their end, so no choice was made; "
                          f"every block but the last stays offloaded: pass layers=[...] to "
                          f"choose", RuntimeWarning, stacklevel=4)
            return
        fresh = _Calibration(len(self.blocks))
        fresh.bandwidths = cal.bandwidths  # measured once
        self._calibration, self._timed_fwd = fresh, self._fwd

    def _copy_rates(self) -> tuple[float, float]:
        """``(offload, reload)`` bytes/s (:func:`tiermem.offload.calibration.copy_rates`)."""
        return copy_rates(self._store.device, self.tier, self._store.config.nvme_dir)

    def _plan_layers(self) -> None:
        """``layers="auto"``: choose the offloaded blocks from the timed forward (called once,
        under the lock, when the forward after it starts; see
        :func:`tiermem.offload.calibration.plan_layers`) and keep them from then on."""
        cal, self._calibration = self._calibration, None
        layers, self.plan = plan_layers(cal, self.policy, self._store.device, self.max_kept_bytes)
        self.policy = dataclasses.replace(self.policy, layers=layers)

    # ------------------------------------------------------------------ pack

    def _is_candidate(self, t: torch.Tensor) -> bool:
        strided = t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)
        # a parameter, a view of any parameter (a Linear saves weight.t()), or a tensor on the
        # storage of a block's parameter or buffer (Note [offload rules], rule 1)
        is_weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or (
            strided and t.untyped_storage().data_ptr() in self._weight_ptrs)
        return self.policy.offloads_tensor(t.numel() * t.element_size(), is_weight,
                                           t.device == self._store.device, strided)

    def _pack(self, t: torch.Tensor) -> Any:
        # what is kept is detached: a saved output returned with its grad_fn would make a
        # reference cycle (node -> saved variable -> tensor -> node) and leak the graph;
        # autograd restores the grad_fn on unpack, and detach() shares the version counter
        # (checked on unpack: Note [saved versions] in tiermem/offload/versions.py)
        if _in_backward():
            return Kept(t.detach(), BACKWARD)
        if not self._is_candidate(t):
            return Kept(t.detach(), self._current)
        with self._lock:
            self.counters["packed"] += 1
            if self._regions:  # Note [offload rules], rule 10: a region offloads everything
                handle = _Saved(self, t.detach())
                self._offload(handle, self._regions[-1])
                return handle
            marked = _is_marked(t)
            layer = self._current
            if layer is None:  # outside every block: the next one's (Note [offload rules], rule 1)
                self._unassigned += 1
                handle = _Saved(self, t.detach(), marked)
                self._pending.append(weakref.ref(handle))
                return handle
            if self._calibrating():
                self._calibration.saved(layer, t)
            if not (marked or self.policy.offloads_layer(layer)):
                self.counters["kept"] += 1
                return Kept(t.detach(), layer)
            handle = _Saved(self, t.detach())
            if self._calibrating():  # Note [timed forward]: offloaded once the block has ended
                self._deferred.append((weakref.ref(handle), (self._fwd, layer)))
                return handle
            self._offload(handle, (self._fwd, layer))
            return handle

    # ------------------------------------------------ regions (Note [offload rules], rule 10)

    def _open_region(self) -> None:
        """Start a region: tensors saved until :meth:`_close_region` go to the store as one
        group, whatever block they are in (no forward state changes under ``no_grad`` or in
        backward, e.g. checkpoint recomputation, which saves nothing here)."""
        with self._lock:
            if self._fresh and torch.is_grad_enabled() and not _in_backward():
                # the first region or block of a forward starts it (Note [offload rules], rule 4)
                self._fwd += 1
                self._fresh = False
            self._regions.append((self._fwd, ("region", next(self._region_seq))))

    def _close_region(self) -> None:
        with self._lock:
            self._regions.pop()

    def _offload(self, handle: _Saved, group: Hashable) -> None:
        """Move ``handle``'s storage into the store as part of ``group`` (or share an existing
        key); keep no reference to the device tensor."""
        t = handle.tensor
        refuse_capture("offload_activations", "saving a tensor to offload",
                       "keep graphed modules out of the offloaded blocks and regions "
                       "(Note [offload rules], rule 11)", t)
        storage = t.untyped_storage()
        dkey = (storage.data_ptr(), t._version)
        rec = self._by_storage.get(dkey)
        if rec is not None and (rec.storage_ref() is not storage or rec.live == 0):
            rec = None
        if rec is None:
            key = ("act", self._uid, next(self._seq))
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            try:
                self._store.put(key, flat, tier=self.tier)
            except TierFullError as exc:
                self.counters["store_full"] += 1
                if self.counters["store_full"] == 1:
                    warnings.warn(f"offload_activations: the store is full ({exc}); saved tensors "
                                  f"that do not fit stay on the device", RuntimeWarning,
                                  stacklevel=3)
                return
            rec = _Record(key, flat.numel(), group, weakref.ref(storage), t._version)
            self._by_storage[dkey] = rec
            self._records += 1
            self.counters["offloaded"] += 1
            self.counters["put_bytes"] += rec.nbytes
        else:
            self.counters["deduplicated"] += 1
        group_records = self._groups.setdefault(group, [])
        if not group_records or group_records[-1] is not rec and rec not in group_records:
            group_records.append(rec)
        rec.live += 1
        handle.tracker = version_tracker(t)  # Note [saved versions]: the version, not the memory
        handle.record, handle.group, handle.tensor = rec, group, None

    # ------------------------------------------------------------------ unpack

    # Note [handed-out reloads]: an offloaded tensor's unpack returns a fresh ``as_strided``
    # view of memory the offloader may use again: the store's reloaded copy (kept while other
    # handles of its key live, e.g. for the next backward of a retained graph) or a slice of
    # a double-buffer set (overwritten by a later load). Autograd can keep that tensor past
    # the node that unpacked it, and write it: AccumulateGrad takes a gradient nothing else
    # refers to as the parameter's ``.grad`` without copying, and later adds into it in place;
    # a backward that returns a saved tensor itself as a gradient (fused loss kernels do:
    # Liger's fused linear cross-entropy returns its saved ``grad_weight``) hands it exactly
    # that. A double-backward graph (``create_graph=True``) saves the unpacked tensors too.
    # Without offload autograd hands out the saved tensor itself, which the saved variable
    # still refers to, so AccumulateGrad copies it. Two rules keep the offloader's memory its
    # own: (1) while autograd keeps the graph (``retain_graph=True``, ``create_graph=True``)
    # the unpack returns a private copy of the reloaded storage (one device copy per unpack,
    # in such backwards only; the copies a double-backward graph saves live as long as it
    # does, beside the store's reloaded copies, which a kept graph keeps too): the old code handed the store's copy to ``.grad``, and each
    # later backward read what had been accumulated into it (a saved gradient returned by
    # three backwards came out 4x, not 3x); (2) a double-buffer set whose memory is still
    # referenced elsewhere when its next load comes takes new memory and leaves the old to
    # its holder (tiermem/offload/double_buffer.py; ``stats()["buffer_replaced"]``, 0 in
    # plain training): the old code overwrote a ``.grad`` taken that way with a later
    # layer's data, and raised a false in-place error in double backward. Not covered, no
    # model known to do it: without a kept graph, a gradient taken that way shares the store's
    # copy while another saved tensor on the same storage (rule 2 of Note [offload rules]) is
    # still to be unpacked, and a second accumulation into that ``.grad`` before then would
    # change what it reads. Tested by tests/offload/test_offload_corners.py.

    def _unpack(self, handle: Any) -> torch.Tensor:
        if type(handle) is Kept:
            return handle.unpack()
        rec = handle.record  # Note [saved versions]: autograd's check, before any reload
        check_version(handle.version, handle.tensor if rec is None else handle.tracker,
                      handle.dtype, handle.size, self._store.device, handle.group,
                      None if rec is None else self.tier)
        with self._lock:
            self._note_backward()
            if rec is None:
                return handle.tensor
            self._enter_group(handle.group)
            # Note [handed-out reloads]: a kept graph reads the same copy again
            data = self._load(rec, private=torch._C._autograd._get_current_graph_task_keep_graph())
        base = data.view(handle.dtype)  # as_strided's offset counts from the storage start
        out = base.as_strided(handle.size, handle.stride, base.storage_offset() + handle.offset)
        if handle.neg:  # Note [offload rules], rule 2: the bits as_strided does not carry
            out = torch._neg_view(out)
        return out.conj() if handle.conj else out

    def _note_backward(self) -> None:
        """On the first unpack of a backward: drop pending tensors, prefetch the last groups."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._graph_task:
            return
        self._graph_task = task
        self._pending.clear()  # the model's tail (after the last block) stays on the device
        self._deferred.clear()
        self._fresh = True
        self._entered_groups.clear()
        self._prefetch(self.policy.prefetch_targets(list(self._groups), None))

    def _enter_group(self, group: Hashable) -> None:
        if group in self._entered_groups:
            return
        self._entered_groups.add(group)
        self._prefetch(self.policy.prefetch_targets(list(self._groups), group))

    def _prefetch(self, groups: list) -> None:
        for group in groups:
            records = [r for r in self._groups.get(group, ()) if r.live and not r.prefetched]
            if not records:
                continue
            for rec in records:
                rec.prefetched = True
            if self._buffers is not None:
                self._load_buffered(records)
                continue
            for rec in records:
                try:
                    self._store.prefetch(rec.key, "gpu")
                    self.counters["prefetches"] += 1
                except TierFullError:  # no room now: get() loads it when it is needed
                    pass

    def _load_buffered(self, records: list[_Record]) -> None:
        try:
            self._buffers.load(records, self._store)
            self.counters["prefetches"] += len(records)
        except TierFullError:  # host tier full while reading back from disk: get() loads later
            for rec in records:
                rec.slot = None

    def _load(self, rec: _Record, private: bool = False) -> torch.Tensor:
        """The record's bytes on the compute device (uint8, ``rec.nbytes``); ``private``: a
        copy nothing else refers to (Note [handed-out reloads])."""
        self.counters["reloads"] += 1
        if self._buffers is not None:
            data = self._buffers.view(rec)
            if data is not None:
                return data.clone() if private else data
        try:
            data = self._store.get(rec.key).reshape(-1).view(torch.uint8)
            return data.clone() if private else data
        except TierFullError:  # the store's gpu tier cannot take it: copy it out directly
            self.counters["gpu_full"] += 1
            host = self._store.get(rec.key, tier="cpu").reshape(-1).view(torch.uint8)
            # a blocking copy: the host block may be reused by the store once we return
            return host.to(self._store.device, copy=True)

    # ------------------------------------------------------------------ release

    def _release(self, rec: _Record) -> None:
        """A handle of ``rec`` died (Note [offload rules], rule 3): delete its key if last."""
        with self._lock:
            rec.live -= 1
            if rec.live:
                return
            if self._buffers is not None:
                self._buffers.release_key(rec.key, self._store)
            self._store.delete(rec.key)
            self._records -= 1
            for g in list(self._groups):  # a deduplicated record can sit in several groups
                recs = self._groups[g]
                if rec in recs:
                    recs.remove(rec)
                    if not recs:
                        del self._groups[g]
            for dkey in [k for k, r in self._by_storage.items() if r is rec]:
                del self._by_storage[dkey]
            self._maybe_close()

    def stats(self) -> dict:
        """Return ``counters`` plus ``live_keys`` and, with double buffering, its figures."""
        out = dict(self.counters, live_keys=self._records)
        if self._buffers is not None:
            out.update(buffer_loads=self._buffers.loads, buffer_fallbacks=self._buffers.fallbacks,
                       buffer_replaced=self._buffers.replaced,
                       buffer_bytes=self._buffers.capacity_bytes())
        return out


def offload_activations(blocks: Sequence[nn.Module], *, store: TierStore | None = None,
                        tier: str = _D["tier"], num_layers: int | None = _D["num_layers"],
                        layers: Iterable[int] | str | None = None,
                        prefetch_depth: int = _D["prefetch_depth"],
                        min_offload_bytes: int = _D["min_offload_bytes"],
                        offload_weights: bool = _D["offload_weights"],
                        double_buffering: bool = _D["double_buffering"],
                        max_kept_bytes: int | None = _D["max_kept_bytes"]) -> ActivationOffloader:
    """Offload the activations autograd saves inside chosen blocks; use as a context manager.

    ::

        with offload_activations(model.blocks):     # which blocks: chosen by measurement
            loss = model(idx, targets)[1]
            loss.backward()          # may also run after the with block

    Args:
        blocks: the model's layer modules in execution order (a list, ``nn.ModuleList`` or
            ``nn.Sequential``, e.g. ``model.transformer.h``).
        store: the :class:`~tiermem.TierStore` to use; None makes a private one on first
            entry (see :func:`default_store_config`), kept for the offloader's life so its
            pinned blocks serve every step, and closed by :meth:`ActivationOffloader.close` or
            when the offloader is garbage-collected.
        tier: ``"cpu"`` (pinned host memory) or ``"nvme"`` (spill files; needs a store with an
            nvme budget).
        num_layers: offload the first ``num_layers`` blocks, in ``[0, len(blocks))`` (Megatron's
            ``cpu_offloading_num_layers``).
        layers: explicit block indices to offload instead of ``num_layers``, or ``"auto"``
            (the default when neither is given): the first two forwards offload all blocks but
            the last and the second is timed per block (forward time, saved bytes); when the
            third starts, the blocks whose copies hide behind compute are chosen
            (:func:`tiermem.schedule.layers.choose_layers`; backward taken as twice forward,
            copy bandwidths measured once, with ``tier="nvme"`` no faster than the disk, and on
            CUDA the host's time to issue and to offload each block counted: Note [timed
            forward]) and kept from then on; ``plan`` says what was chosen and why.
        prefetch_depth: when backward enters layer ``i``, layers ``i-1 ... i-prefetch_depth``
            are reloaded in the background (>= 1).
        min_offload_bytes: saved tensors smaller than this many bytes stay on the device.
        offload_weights: also offload parameters and buffers that autograd saves.
        double_buffering: reload into two persistent device buffer sets, alternating between
            layers, instead of fresh allocations (needs ``prefetch_depth=1``; for sequential
            stacks of blocks, see Note [offload rules], rule 6).
        max_kept_bytes: with ``"auto"``: at most this many bytes of block activations stay on
            the device (more blocks are offloaded, least stall first, to meet it). Default: on
            CUDA, what stayed in the timed forward plus 80% of the device memory still unused
            at the choice (``total - max_memory_allocated``); no bound on the CPU.

    Returns:
        an :class:`ActivationOffloader` (enter it with ``with``).

    Raises:
        TypeError: ``blocks`` is not a sequence of modules, ``num_layers`` and ``layers`` both
            given, a non-integer count, ``store`` not a TierStore.
        ValueError: ``num_layers`` or a ``layers`` index outside ``[0, len(blocks))``, an
            unknown ``layers`` string, ``prefetch_depth`` < 1, unknown ``tier``,
            ``tier="nvme"`` without an nvme budget, ``double_buffering`` with
            ``prefetch_depth`` > 1, ``min_offload_bytes`` < 0, ``max_kept_bytes`` < 0 or given
            with explicit layers.
        RuntimeError: (on entry) another offload context is active on this thread, or this
            one is entered on another (each thread may enter its own, for its own model).
    """
    return ActivationOffloader(blocks, store=store, tier=tier, num_layers=num_layers, layers=layers,
                               prefetch_depth=prefetch_depth, min_offload_bytes=min_offload_bytes,
                               offload_weights=offload_weights, double_buffering=double_buffering,
                               max_kept_bytes=max_kept_bytes)
