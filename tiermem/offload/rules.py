"""The rules of activation offload, and the policy and argument checks that apply them.

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
   back as views of the same data, with the conjugate and negative bits of lazy views
   (``a.conj()``, ``a.conj().imag``: their bytes are ``a``'s), which ``as_strided`` does not
   carry (the old code dropped them: ``a.conj() * b`` gave wrong gradients, silently).
3. *Lifetime.* The pack hook keeps no reference to the device tensor (the store marks it used by
   its D2H stream). Each saved tensor's handle lives exactly as long as autograd keeps the saved
   variable: backward without ``retain_graph`` releases a node's saved variables right after the
   node ran, and when the last handle of a key dies the key is deleted from the store, which
   frees the reloaded copy as soon as backward no longer needs it. With ``retain_graph=True`` the
   handles live on, so the reloaded copies stay in the store's ``"gpu"`` tier (under its budget;
   the store evicts them back down under pressure) until the graph is freed; a second backward
   then works. While autograd keeps the graph (``retain_graph=True``, ``create_graph=True``)
   each unpack returns a private copy of the reloaded storage, so nothing autograd keeps or
   writes (a ``.grad``, a double-backward graph) shares the copy the next backward reads
   (Note [handed-out reloads] in tiermem/offload/activations.py). A graph dropped without
   backward deletes its keys the same way.
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
   instead (still correct). A *reloaded tensor still referenced when its set's next load comes*
   (taken as a ``.grad`` without a copy, or otherwise held past its layer) makes the set take
   new memory and leave the old to its holder (Note [handed-out reloads];
   ``stats()["buffer_replaced"]``); the old code overwrote it. The sets save allocations only
   where reloads die with their layer, as in a sequential stack of blocks.
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
   ``torch.compiler.disable``: dynamo never traces them (a traced hook's side effects happen
   once, at compile time, and the compiled graph would then save every tensor outside any
   block: nothing offloaded). A
   compiled model therefore breaks its graph at each block boundary and runs the hooks
   eagerly: blocks compiled one by one (``block.compile()`` or ``torch.compile(block)`` in the
   list) give the same graphs as without offload and train bit-identically; a whole-model
   ``torch.compile`` is split at the block boundaries, so its fusions across blocks (and only
   those) round differently. A graph compiled *before* the hooks existed ignores them (dynamo
   does not guard on module hooks): if a forward inside the context saves tensors but no block
   hook runs, ``__exit__`` raises ``RuntimeError`` instead of silently offloading nothing.
   Tested by tests/offload/test_compile.py and the CUDA parity matrix. The same holds when
   the block hooks ran only under ``torch.no_grad()``: ``torch.utils.checkpoint(...,
   use_reentrant=True)`` runs its blocks so and saves their inputs outside them; the message
   then names ``use_reentrant=False`` (the old one blamed torch.compile).
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
   A write no version counter sees (through ``x.data``, or a tensor made with ``set_`` on the
   same storage) raises nowhere: plain autograd then reads the new values in backward, an
   offloaded tensor the values it had when it was offloaded (not detectable; kept tensors
   read the new values, as plain autograd does).

Where each rule lives: 1 and 8's choice here (:class:`LayerPolicy`) and in
tiermem/offload/activations.py (the hooks); 2-5, 7, 9 and 10 in the hooks; 6 in
tiermem/offload/double_buffer.py; 8's timing in tiermem/offload/calibration.py; 10's regions
and marks in tiermem/offload/tensors.py and tiermem/offload/marks.py; 11 in tiermem/_graphs.py;
12 in tiermem/offload/versions.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Hashable

from torch import nn

from tiermem import options
from tiermem.store import TierStore


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


def check_arguments(blocks: Sequence[nn.Module], store: TierStore | None, tier: str,
                    num_layers: int | None, layers: Iterable[int] | str | None,
                    prefetch_depth: int, min_offload_bytes: int, offload_weights: bool,
                    double_buffering: bool, max_kept_bytes: int | None,
                    regions_only: bool = False) -> tuple[list[nn.Module], bool]:
    """Check :func:`~tiermem.offload.offload_activations`' arguments; return the blocks as a
    list and whether ``layers`` is ``"auto"`` (given, or neither ``layers`` nor ``num_layers``).

    ``regions_only``: a tensor-level offloader (:mod:`tiermem.offload.tensors`), which may have
    no blocks.

    Raises:
        TypeError: ``blocks`` is not a sequence of modules, ``store`` not a TierStore,
            ``num_layers`` with ``layers="auto"``, or a non-integer count.
        ValueError: an empty ``blocks``, an unknown ``tier`` or ``layers`` string,
            ``prefetch_depth`` < 1, ``min_offload_bytes`` or ``max_kept_bytes`` < 0,
            ``double_buffering`` with ``prefetch_depth`` > 1, ``tier="nvme"`` without an nvme
            budget, ``max_kept_bytes`` with explicit layers.
    """
    where = "offload_activations"
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"{where}: blocks must be a list or nn.ModuleList of the layer "
                        f"modules (e.g. model.transformer.h), got one {type(blocks).__name__}")
    try:
        blocks = list(blocks)
    except TypeError:
        raise TypeError(f"{where}: blocks must be a list or nn.ModuleList of the layer "
                        f"modules, got {type(blocks).__name__}") from None
    if not blocks and not regions_only:
        raise ValueError(f"{where}: blocks is empty; pass the model's layer modules")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"{where}: blocks[{i}] is a {type(b).__name__}, not an nn.Module")
    # Note [one definition] in tiermem/options.py: the activations section's checks and rules
    # (num_layers is checked against the blocks by resolve_layers)
    options.check_section("activations", options.Who(f"{where}: "), dict(
        tier=tier, prefetch_depth=prefetch_depth, min_offload_bytes=min_offload_bytes,
        offload_weights=offload_weights,
        double_buffering=double_buffering, max_kept_bytes=max_kept_bytes), "api",
        rules=False)
    options.check_rule("activations", "double_buffering", options.Who(f"{where}: "),
                       dict(double_buffering=double_buffering, prefetch_depth=prefetch_depth))
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
    options.check_rule("activations", "max_kept_bytes", options.Who(f"{where}: "),
                       dict(max_kept_bytes=max_kept_bytes, num_layers=num_layers,
                            layers=layers))
    return blocks, auto
