"""Activation offload: saved tensors of chosen layers go through a TierStore, back in reverse order.

``offload_activations(model.blocks)`` is a context manager over
:class:`torch.autograd.graph.saved_tensors_hooks` that knows the layer boundaries (forward
pre-hooks on each block). Tensors autograd saves inside an offloaded layer are put into the store
(``"cpu"``: pinned host memory; ``"nvme"``: spill files) and their device memory is released as
soon as the forward drops them and the D2H copy has finished. In backward they come back in
reverse layer order: when backward first needs layer ``i`` it prefetches layers ``i-1 ...
i-prefetch_depth``.

Note [offload rules] (referred to from code and tests):

1. *Which tensors.* A tensor saved while block ``i`` runs belongs to layer ``i``. A tensor saved
   outside every block belongs to the next block entered in the same forward: this is how the
   input of a ``torch.utils.checkpoint`` region (saved just before the block runs) is offloaded
   with its block. If backward starts first (the tail of the model: final norm, LM head, loss)
   it stays on the device. Skipped: parameters and buffers of the blocks and any parameter or
   view of one (a ``Linear`` saves ``weight.t()``; a region of tensor-level offload has no
   blocks, and without this it copied a LoRA layer's frozen base weight out every step), unless
   ``offload_weights``; tensors smaller than ``min_offload_bytes``, tensors not on the store's
   compute device (e.g. CPU tensors when the device is CUDA), non-strided tensors, and anything
   saved while backward runs (checkpoint recomputation, double backward).
2. *Storage, not tensors.* What moves is the tensor's whole storage, once: two saved tensors on
   the same live storage with the same version counter share one store key (a tensor saved by
   two ops, or ``q``/``k``/``v`` views of one projection). Unpack rebuilds each saved tensor with
   ``as_strided`` (same size, stride and storage offset) on the reloaded storage, so views come
   back as views of the same data.
3. *Lifetime.* The pack hook keeps no reference to the device tensor (the store marks it used by
   its D2H stream). Each saved tensor's handle lives exactly as long as autograd keeps the saved
   variable: backward without ``retain_graph`` releases a node's saved variables right after the
   node ran, and when the last handle of a key dies the key is deleted from the store, which
   frees the reloaded copy as soon as backward no longer needs it. With ``retain_graph=True`` the
   handles live on, so the reloaded copies stay in the store's ``"gpu"`` tier (under its budget;
   the store evicts them back down under pressure) until the graph is freed; a second backward
   then works. A graph dropped without backward deletes its keys the same way.
4. *Forwards.* Every forward gets a new id (a block index that does not increase, or a forward
   after a backward started, starts a new one), so several forwards before one backward
   (gradient accumulation) keep separate keys; forwards under ``torch.no_grad()`` save nothing
   and change no state.
5. *Synchronisation.* No device-wide synchronisation. The store orders its copies with events on
   its own streams (Note [side-stream buffers] and Note [reaped reload] in
   tiermem/store/transfer.py). Double buffering adds one H2D stream that
   waits on the compute stream before it overwrites a buffer set, and the compute stream waits on
   the load's event before it reads one.
6. *Double buffering* (``double_buffering=True``): reloads land in two persistent device buffer
   sets used alternately by consecutively loaded layers, instead of fresh allocations. A set is
   overwritten two loads later, when backward has entered the next layer, i.e. (for a
   sequential stack of blocks) when no kernel reading the old layer can still be queued after
   the overwrite. A saved tensor unpacked after its set was reused is reloaded from the store
   instead (still correct); a *reloaded tensor kept alive by autograd beyond its layer* would see
   the overwrite, so use double buffering only for sequential stacks of blocks.
7. *Full tiers.* A saved tensor the store cannot take (``TierFullError`` from ``put``) stays on
   the device (one ``RuntimeWarning``, counted in ``stats()["store_full"]``). A reload that the
   store's ``"gpu"`` tier cannot take is copied straight out of the ``"cpu"`` tier with a
   blocking copy (``stats()["gpu_full"]``): size the gpu budget for the prefetch window to
   avoid it.
8. *Automatic layers* (``layers="auto"``, the default). The first two forwards of one
   offloader offload every block but the last; the second is timed per block (CUDA events at
   the block hooks, read later without a device-wide wait) and its saved bytes are counted per
   block, and the copy bandwidths are measured as it starts (its one device synchronisation;
   with ``tier="nvme"`` also the spill directory's disk, and the slower of the two counts);
   its blocks' tensors are offloaded as each block exits (Note [timed forward]).
   When the third forward starts, :func:`tiermem.schedule.layers.choose_layers` picks the blocks
   whose copies hide behind compute and the policy keeps them from then on (``plan``). Make
   the offloader once and enter it every step: a new one starts measuring again.
9. *torch.compile.* The block hooks and the pack/unpack hooks are wrapped in
   ``torch.compiler.disable``: dynamo never traces them (a traced hook's side effects happen once, at compile time, and
   the compiled graph would then save every tensor outside any block: nothing offloaded). A
   compiled model therefore breaks its graph at each block boundary and runs the hooks
   eagerly: blocks compiled one by one (``block.compile()`` or ``torch.compile(block)`` in the
   list) give the same graphs as without offload and train bit-identically; a whole-model
   ``torch.compile`` is split at the block boundaries, so its fusions across blocks (and only
   those) round differently. A graph compiled *before* the hooks existed ignores them (dynamo
   does not guard on module hooks): if a forward inside the context saves tensors but no block
   hook runs, ``__exit__`` raises ``RuntimeError`` instead of silently offloading nothing.
   Tested by tests/offload/test_compile.py and the CUDA parity matrix.
10. *Tensor-level offload* (:mod:`tiermem.offload.tensors`). Inside an ``offload_tensors()``
   region every candidate tensor autograd saves is offloaded, whatever block it is in; one
   region entry is one group, prefetched in backward like a block (regions and blocks share
   one forward order). A tensor marked with ``mark_for_offload(t)`` (attribute
   ``activation_offloading``, as Megatron-Core marks them) is offloaded even inside a block
   the policy keeps. Entered while another offloader is active, a region opens on that one
   (its store, its prefetch); alone it installs its own hooks. Rules 1-9 apply unchanged.
11. *CUDA graphs.* A tensor saved while the current stream captures a CUDA graph raises
   ``RuntimeError`` (Note [cuda graphs] in tiermem/_graphs.py): a replay would skip the
   store's copies. Keep graphed modules (``torch.cuda.make_graphed_callables``) out of the
   blocks and regions; the blocks around them offload as usual.
12. *In-place changes.* A saved tensor (kept or offloaded) changed in place before backward
   unpacks it raises autograd's ``RuntimeError``, naming where it was saved: autograd skips
   its check under saved-tensor hooks (Note [saved versions] in tiermem/offload/versions.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable

import torch
from torch import nn

from tiermem._graphs import refuse_capture
from tiermem.config import StoreConfig
from tiermem.names import OFFLOAD_TIERS, check_bool, check_choice, check_int
from tiermem.schedule.layers import (BlockCosts, choose_layers, copy_bandwidths, disk_bandwidths,
                                     kept_budget_bytes, simulate)
from tiermem.offload.double_buffer import DoubleBuffer
from tiermem.offload.versions import BACKWARD, Kept, check_version, version_tracker
from tiermem.store import TierFullError, TierStore

_HOST_FRACTION = 0.5  # share of MemAvailable a private store may pin for its cpu tier
_CALIBRATION_FORWARD = 2  # layers="auto" times this forward (the first one warms up)
_BWD_PER_FWD = 2.0  # backward compute of a block, in forwards (its two matmuls per forward one)
_ROOM_FRACTION = 0.8  # share of the device memory left unused that auto may fill with activations


MARK = "activation_offloading"
"""The tensor attribute :func:`tiermem.offload.mark_for_offload` sets (the name Megatron-Core
uses, so tensors marked for it are honoured too)."""


_MARKED: dict[int, weakref.ref] = {}  # id(storage) -> weakref: storages of marked tensors
# the offloader entered on each thread: saved-tensor hooks are per thread, so each thread may
# train its own model under its own context (one per thread: nesting is refused)
_ACTIVE = threading.local()


def active_offloader() -> "ActivationOffloader | None":
    """The offload context entered on the calling thread, if any."""
    return getattr(_ACTIVE, "offloader", None)


def mark_storage(t: torch.Tensor) -> None:
    """Remember ``t``'s storage as marked: ops often save a view of a marked tensor (a linear
    layer saves its input reshaped to 2-D), a new tensor object without the attribute."""
    storage = t.untyped_storage()
    key = id(storage)
    _MARKED[key] = weakref.ref(storage, lambda _, key=key: _MARKED.pop(key, None))


def _is_marked(t: torch.Tensor) -> bool:
    if getattr(t, MARK, False):
        return True
    if not _MARKED or t.layout != torch.strided:
        return False
    storage = t.untyped_storage()
    ref = _MARKED.get(id(storage))
    return ref is not None and ref() is storage


def _in_backward() -> bool:
    """True while the autograd engine is executing (recomputation, hooks, double backward)."""
    return torch._C._current_graph_task_id() != -1


def available_host_bytes() -> int:
    """Return the host memory available to new allocations in bytes (``MemAvailable``).

    Falls back to free physical pages where ``/proc/meminfo`` is missing.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_store_config() -> StoreConfig:
    """Return the config of the private store made when ``offload_activations(store=None)``.

    cpu tier: half of the host memory available now (``MemAvailable``; pinned on CUDA, taken
    lazily in slabs of up to 256 MiB, so a large budget costs nothing until used). gpu tier (the
    reloaded activations, which would be on the device anyway without offload): the device's
    total memory on CUDA, the cpu budget otherwise. No nvme tier: spilling to disk needs a store
    made with ``nvme_bytes`` and ``nvme_dir`` (a default directory could be a RAM disk).
    """
    cpu_bytes = max(1 << 20, int(available_host_bytes() * _HOST_FRACTION) // 4096 * 4096)
    if torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        gpu_bytes = cpu_bytes
    return StoreConfig(gpu_bytes=gpu_bytes, cpu_bytes=cpu_bytes, nvme_bytes=0,
                       pool_slab_bytes=min(256 << 20, cpu_bytes))


# ---------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class LayerPolicy:
    """Which layers and which saved tensors are offloaded, and what to prefetch (pure; no torch
    state, unit-testable).

    Attributes:
        num_blocks: number of blocks in the stack.
        layers: indices of the offloaded blocks.
        min_offload_bytes: smaller saved tensors stay on the device.
        offload_weights: offload parameters and buffers too.
        prefetch_depth: layers prefetched ahead of the one backward is in.
    """

    num_blocks: int
    layers: frozenset[int]
    min_offload_bytes: int
    offload_weights: bool
    prefetch_depth: int

    def offloads_layer(self, layer: int | None) -> bool:
        """True if saved tensors of ``layer`` (None: outside every block) are offloaded."""
        return layer is not None and layer in self.layers

    def offloads_tensor(self, nbytes: int, is_weight: bool, on_device: bool, strided: bool) -> bool:
        """True if a saved tensor with these properties is a candidate for offload."""
        if not on_device or not strided or nbytes == 0:
            return False
        if is_weight and not self.offload_weights:
            return False
        return nbytes >= self.min_offload_bytes

    def prefetch_targets(self, order: Sequence[Hashable], current: Hashable | None) -> list:
        """Groups to prefetch when backward enters group ``current`` (None: backward starts).

        ``order`` lists the offloaded groups in forward order; backward walks it in reverse, so
        the targets are the ``prefetch_depth`` groups before ``current`` (or the last ones),
        nearest first.
        """
        end = len(order) if current is None else (
            order.index(current) if current in order else 0)
        start = max(0, end - self.prefetch_depth)
        return list(reversed(order[start:end]))


def resolve_layers(num_blocks: int, num_layers: int | None,
                   layers: Iterable[int] | None) -> frozenset[int]:
    """Return the offloaded block indices (default: all but the last block).

    Raises:
        TypeError: both ``num_layers`` and ``layers`` given, or non-integer values.
        ValueError: ``num_layers`` outside ``[0, num_blocks)`` or an index outside
            ``[0, num_blocks)``.
    """
    where = "offload_activations"
    if num_layers is not None and layers is not None:
        raise TypeError(f"{where}: pass num_layers={num_layers!r} or layers={layers!r}, not both "
                        f"(num_layers offloads the first N blocks, layers names them)")
    if layers is not None:
        layers = list(layers)
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"{where}: layers must hold block indices (int), got {i!r}")
            if not 0 <= i < num_blocks:
                raise ValueError(f"{where}: layers contains {i}, outside [0, {num_blocks}): the "
                                 f"model has {num_blocks} blocks; use indices 0..{num_blocks - 1}")
        return frozenset(layers)
    if num_layers is None:
        return frozenset(range(num_blocks - 1))
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"{where}: num_layers must be an int, got {num_layers!r}")
    if not 0 <= num_layers < num_blocks:
        raise ValueError(f"{where}: num_layers={num_layers} is outside [0, {num_blocks}): the "
                         f"model has {num_blocks} blocks; pass num_layers < {num_blocks} (the last "
                         f"block's activations are needed first in backward; to offload it too, "
                         f"name it in layers=[...])")
    return frozenset(range(num_layers))



class _Calibration:
    """Per-block forward time and saved bytes of one forward (``layers="auto"``).

    Times come from CUDA events on the compute stream (read once the forward is done), or the
    host clock without CUDA; bytes count each saved storage once per block.

    Note [timed forward]: the timed forward offloads every block but the last (as the first
    does: memory stays bounded while nothing is known), but it offloads each block's saved
    tensors when the block exits, after its end event, instead of in the pack hook: what the
    events bracket is then the block's own kernels, not the host work of its puts (store
    bookkeeping, pinned slots, copy issue) nor any wait a put adds. With the puts in the pack
    hook, the H200 timed the reference GPT's blocks (8 x 2048 tokens, d_model 2048) at a median
    5.1 and 6.8 ms in two runs, while checkpointing's recompute puts a block's forward at ~2.4 ms;
    choose_layers then believed 2-3x more copy time hid behind compute than does and chose 5-8
    blocks: the table row with the chunked loss took 1.24x of no offload. With the puts after
    the end event and the host clock below, the H200 timed a block at 2.99 ms and auto chose 3
    blocks at 0.99x (docs/benchmarks.md, at ee65090). The host seconds of each block, start
    to end hook (``plan["host_ms"]``), and of its deferred puts (``offload_host_s``,
    ``plan["offload_host_ms"]``) are kept too: on CUDA the host only issues the work, and
    choose_layers runs a host clock beside the device's (tiermem/schedule/layers.py), so a
    block whose puts would leave the device waiting for the host is not chosen; on the CPU the
    host computes the blocks, and its clock is the one timed. The peak of the timed forward
    grows by at most one block's saved tensors.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.marks: dict[int, list] = {}  # block -> [start, end] (events or perf_counter)
        self.nbytes = [0] * num_blocks
        # per block: data_ptr -> weakref of the storage counted there (an offloaded storage is
        # freed in forward and its address reused, so the pointer alone does not identify it)
        self.storages: list[dict[int, weakref.ref]] = [{} for _ in range(num_blocks)]
        self.bandwidths: tuple[float, float] | None = None  # (d2h, h2d) bytes/s
        # host seconds each block's deferred offloads took at its exit (Note [timed forward])
        self.offload_host_s = [0.0] * num_blocks
        self.host_marks: dict[int, list] = {}  # block -> [host start, host end] (perf_counter)

    def _mark(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # times the block's kernels
            return event
        return time.perf_counter()

    def enter(self, index: int, device: torch.device) -> None:
        self.host_marks[index] = [time.perf_counter(), None]
        self.marks[index] = [self._mark(device), None]

    def exit(self, index: int, device: torch.device) -> None:
        if index in self.marks:
            self.marks[index][1] = self._mark(device)
            self.host_marks[index][1] = time.perf_counter()

    def host_seconds(self) -> list[float]:
        """Host seconds from each block's start to its end hook (its Python and launches; the
        deferred puts come after, in ``offload_host_s``)."""
        return [max(0.0, end - start) for start, end in
                (self.host_marks[i] for i in range(self.num_blocks))]

    def saved(self, index: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        seen = self.storages[index].get(storage.data_ptr())
        if seen is None or seen() is not storage:
            self.storages[index][storage.data_ptr()] = weakref.ref(storage)
            self.nbytes[index] += storage.nbytes()

    def complete(self) -> bool:
        return len(self.marks) == self.num_blocks and all(e is not None
                                                          for _, e in self.marks.values())

    def fwd_seconds(self) -> list[float]:
        out = []
        for i in range(self.num_blocks):
            start, end = self.marks[i]
            if isinstance(start, float):
                out.append(max(0.0, end - start))
            else:
                end.synchronize()  # the timed forward ran long ago; this returns at once
                out.append(start.elapsed_time(end) / 1e3)
        return out

# ---------------------------------------------------------------------------------- records


@dataclass(eq=False)
class _Record:
    """One offloaded storage: a store key shared by the saved tensors on that storage."""

    key: Hashable
    nbytes: int
    group: Hashable
    storage_ref: Any  # weakref to the device storage while it lives (dedup only while alive)
    version: int
    live: int = 0  # handles (saved variables) referring to it
    prefetched: bool = False
    slot: "tuple[int, int, int] | None" = None  # double buffering: (set, generation, offset)


class _Saved:
    """What the pack hook returns: a saved tensor, offloaded (``record``) or kept (``tensor``)."""

    __slots__ = ("owner", "tensor", "record", "group", "dtype", "size", "stride", "offset",
                 "version", "marked", "tracker", "__weakref__")

    def __init__(self, owner: "ActivationOffloader", tensor: torch.Tensor,
                 marked: bool = False) -> None:
        self.owner = owner
        # mark_for_offload: offloaded even in a kept block (Note [offload rules], rule 10)
        self.marked = marked
        self.tensor: torch.Tensor | None = tensor
        self.record: _Record | None = None
        self.group: Hashable = None
        self.dtype = tensor.dtype
        self.size = tuple(tensor.size())
        self.stride = tuple(tensor.stride())
        self.offset = tensor.storage_offset()
        self.version = tensor._version  # a deferred offload must copy what was saved
        self.tracker: torch.Tensor | None = None  # offloaded: Note [saved versions]

    def __del__(self) -> None:
        record = self.record
        if record is not None:
            try:
                self.owner._release(record)
            except Exception:  # interpreter shutdown or a closed store: nothing left to free
                pass


# ---------------------------------------------------------------------------------- offloader


class ActivationOffloader:
    """Hook state of :func:`offload_activations` (a context manager; see Note [offload rules]).

    Use :func:`offload_activations` to make one; the arguments are documented there. One
    object can be entered again after it exited (e.g. once per training step).
    """

    _uids = itertools.count()
    _regions_only: ClassVar[bool] = False  # tiermem.offload.tensors.TensorOffloader: no blocks

    def __init__(self, blocks: Sequence[nn.Module], *, store: TierStore | None = None,
                 tier: str = "cpu", num_layers: int | None = None,
                 layers: Iterable[int] | str | None = None, prefetch_depth: int = 1,
                 min_offload_bytes: int = 1024, offload_weights: bool = False,
                 double_buffering: bool = False, max_kept_bytes: int | None = None) -> None:
        where = "offload_activations"
        if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"{where}: blocks must be a list or nn.ModuleList of the layer "
                            f"modules (e.g. model.transformer.h), got one {type(blocks).__name__}")
        try:
            blocks = list(blocks)
        except TypeError:
            raise TypeError(f"{where}: blocks must be a list or nn.ModuleList of the layer "
                            f"modules, got {type(blocks).__name__}") from None
        if not blocks and not self._regions_only:
            raise ValueError(f"{where}: blocks is empty; pass the model's layer modules")
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise TypeError(f"{where}: blocks[{i}] is a {type(b).__name__}, not an nn.Module")
        check_choice(f"{where}: ", "tier", tier, OFFLOAD_TIERS,
                     "'cpu' is pinned host memory, 'nvme' spill files")
        check_int(f"{where}: ", "prefetch_depth", prefetch_depth, low=1,
                  unit="layers reloaded ahead of the one backward is in")
        check_int(f"{where}: ", "min_offload_bytes", min_offload_bytes, low=0, unit="bytes")
        check_bool(f"{where}: ", "offload_weights", offload_weights)
        check_bool(f"{where}: ", "double_buffering", double_buffering)
        if double_buffering and prefetch_depth != 1:
            raise ValueError(f"{where}: double_buffering=True has two buffer sets (the layer in "
                             f"use and the one loading), so prefetch_depth={prefetch_depth} "
                             f"cannot work; pass prefetch_depth=1 or double_buffering=False")
        if store is not None and not isinstance(store, TierStore):
            raise TypeError(f"{where}: store must be a tiermem.TierStore, got "
                            f"{type(store).__name__}")
        if tier == "nvme":
            if store is None:
                raise ValueError(f"{where}: tier='nvme' needs a store with an nvme budget: pass "
                                 f"store=TierStore(StoreConfig(nvme_bytes=..., nvme_dir=...))")
            if store.config.nvme_bytes == 0:
                raise ValueError(f"{where}: tier='nvme' but the store has no nvme budget "
                                 f"(StoreConfig.nvme_bytes=0); set nvme_bytes and nvme_dir")
        auto = layers == "auto" or (layers is None and num_layers is None)
        if isinstance(layers, str) and layers != "auto":
            raise ValueError(f"{where}: layers={layers!r} is unknown; pass 'auto' (chosen from "
                             f"measured compute and transfer) or block indices")
        if auto and num_layers is not None:
            raise TypeError(f"{where}: pass num_layers={num_layers!r} or layers='auto', not both")
        if max_kept_bytes is not None:
            check_int(f"{where}: ", "max_kept_bytes", max_kept_bytes, low=0,
                      unit="bytes of block activations allowed to stay on the device")
        if max_kept_bytes is not None and not auto:
            raise ValueError(f"{where}: max_kept_bytes bounds the automatic choice; with explicit "
                             f"num_layers/layers drop it, or pass layers='auto'")
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
        if not torch.is_grad_enabled() or _in_backward() or not self._own_thread():
            return  # eval forwards and checkpoint recomputation change no state
        with self._lock:
            self._offload_deferred()  # an enclosing block's, or one whose exit hook never ran
            if self._fresh or index <= self._last_block:
                self._fwd += 1
                self._fresh = False
                cal = self._calibration
                if cal is not None and self._fwd > _CALIBRATION_FORWARD and cal.complete():
                    self._plan_layers()
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
        return self._calibration is not None and self._fwd == _CALIBRATION_FORWARD

    def _copy_rates(self) -> tuple[float, float]:
        """``(offload, reload)`` bytes/s: PCIe copies, and with ``tier="nvme"`` no faster than
        the spill directory's disk."""
        d2h, h2d = copy_bandwidths(self._store.device, 32 << 20)
        if self.tier == "nvme":
            write, read = disk_bandwidths(self._store.config.nvme_dir)
            d2h, h2d = min(d2h, write), min(h2d, read)
        return d2h, h2d

    def _plan_layers(self) -> None:
        """``layers="auto"``: choose the offloaded blocks from the timed forward (called once,
        under the lock, when the forward after it starts; the blocks' backward is taken as
        ``_BWD_PER_FWD`` forwards) and the copy bandwidths measured when the timed forward
        started (one device synchronisation there); bound what stays on the device by
        ``max_kept_bytes``, or on CUDA by ``_ROOM_FRACTION`` of the memory the steps have left
        unused so far."""
        cal, self._calibration = self._calibration, None
        fwd = cal.fwd_seconds()
        device = self._store.device
        cuda = device.type == "cuda"  # a host clock apart from the device's (Note [timed forward])
        host = cal.host_seconds()
        costs = BlockCosts(tuple(fwd), tuple(_BWD_PER_FWD * f for f in fwd), tuple(cal.nbytes),
                           host_s=tuple(host) if cuda else (),
                           offload_host_s=tuple(cal.offload_host_s) if cuda else ())
        d2h, h2d = cal.bandwidths
        limit = self.max_kept_bytes
        if limit is None and cuda:  # the timed forward's peak holds only the kept blocks
            limit = kept_budget_bytes(cal.nbytes, self.policy.layers,
                                      torch.cuda.get_device_properties(device).total_memory,
                                      torch.cuda.max_memory_allocated(device), _ROOM_FRACTION)
        layers = choose_layers(costs, d2h, h2d, self.policy.prefetch_depth, limit)
        timeline = simulate(costs, layers, d2h, h2d, self.policy.prefetch_depth)
        self.policy = dataclasses.replace(self.policy, layers=layers)
        self.plan = {"layers": sorted(layers), "fwd_ms": [1e3 * f for f in fwd],
                     "nbytes": list(cal.nbytes), "d2h_gbps": d2h / 1e9, "h2d_gbps": h2d / 1e9,
                     "max_kept_bytes": limit, "kept_bytes": timeline.kept_bytes,
                     "predicted_stall_ms": 1e3 * (timeline.stall_s + timeline.late_s
                                                  + timeline.host_stall_s),
                     "host_ms": [1e3 * s for s in host],
                     "offload_host_ms": [1e3 * s for s in cal.offload_host_s]}

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
            data = self._load(rec)
        base = data.view(handle.dtype)  # as_strided's offset counts from the storage start
        return base.as_strided(handle.size, handle.stride, base.storage_offset() + handle.offset)

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

    def _load(self, rec: _Record) -> torch.Tensor:
        """The record's bytes on the compute device (uint8, ``rec.nbytes``)."""
        self.counters["reloads"] += 1
        if self._buffers is not None:
            data = self._buffers.view(rec)
            if data is not None:
                return data
        try:
            return self._store.get(rec.key).reshape(-1).view(torch.uint8)
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
                       buffer_bytes=self._buffers.capacity_bytes())
        return out


def offload_activations(blocks: Sequence[nn.Module], *, store: TierStore | None = None,
                        tier: str = "cpu", num_layers: int | None = None,
                        layers: Iterable[int] | str | None = None, prefetch_depth: int = 1,
                        min_offload_bytes: int = 1024, offload_weights: bool = False,
                        double_buffering: bool = False,
                        max_kept_bytes: int | None = None) -> ActivationOffloader:
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
