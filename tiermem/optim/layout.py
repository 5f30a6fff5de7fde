"""Where HybridAdam's state lives: its param groups, the fp32 state blob of an offloaded chunk
and its views, the slots of the pinned rings, the host bytes all of it needs, the placement of
each chunk (cpu, nvme, or by the cpu budget: Note [split tier]) and the state at step 0.

The planner sizes HybridAdam's host memory with :func:`ring_bytes` (the pinned gradient and
param-out rings) and :func:`nvme_staging_bytes` (the NVMe stream's read-ahead and write-back
room), and its GPU-side state with :func:`gpu_side_state_bytes`, the same functions HybridAdam
allocates (and counts its memory) by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tiermem._log import logger, progress
from tiermem.config import StoreConfig
from tiermem.optim.local_tensor import local_of
from tiermem.optim.partition import Chunk, GroupPlan, plan_group
from tiermem.store.pool import block_bytes
from tiermem.store.store import TierFullError, TierStore

GRAD_SLOTS = 2
"""Chunk-sized pinned buffers a chunk's gradients are copied into just before it steps: the one
being stepped and the next one's copy in flight."""

OUT_SLOTS = 4
"""Chunk-sized pinned buffers the CPU step writes updated params into before their H2D copy:
a ring, so param staging costs 4 chunks instead of 2 bytes per offloaded bf16 param."""

LANE_SLOTS = 3
"""Device slots of the GPU lane (Note [gpu lane] in gpu_lane.py): one chunk's state loading,
one stepping, one writing back."""

WIDE_BATCH_NUMEL = 1 << 24
"""The most elements of the GPU side one fused Adam call steps when something must be widened
to fp32 for it: with bf16 moments the moments (8 B/element) and bf16 gradients (4), with fp32
moments the gradients of non-fp32 params (4); so the step's extra GPU memory is at most 12 B x
this (192 MiB), or 4 B x this (64 MiB), not that per GPU-side param. fp32 moments with fp32
gradients are stepped in one call, in place. A multiple of 16, so a piece cut at it keeps every
element in the same lane of torch's CPU kernel (vector body or scalar tail) as when stepped
whole."""

NVME_EXTRA_CHUNKS = 3
"""Chunk blobs the NVMe stream stages in RAM beyond its ``nvme_lookahead_chunks`` read-ahead:
the chunk being stepped and the write-backs in flight."""

_PROGRESS_MIN_BYTES = 1 << 30
"""Offloaded state of at least this many bytes shows a progress bar while it is set up (on a
terminal; ~4 s per GiB on the H200 host, 54-82 s at 13B-20B); smaller set-ups show none."""


def state_numel(numel: int, moments_dtype: torch.dtype) -> int:
    """fp32 elements of one chunk's state blob: the master, then both moments.

    Raises:
        Nothing.
    """
    return numel * (3 if moments_dtype == torch.float32 else 2)


def lane_slot_bytes(chunk_numel: int, moments_dtype: torch.dtype) -> int:
    """GPU bytes of the GPU lane's ``LANE_SLOTS`` device slots (Note [gpu lane] in
    gpu_lane.py) for chunks of at most ``chunk_numel`` elements: per slot one chunk's fp32
    state blob and its fp32 gradients.

    Raises:
        Nothing.
    """
    return LANE_SLOTS * 4 * (state_numel(chunk_numel, moments_dtype) + chunk_numel)


def state_views(blob: torch.Tensor, numel: int, moments_dtype: torch.dtype):
    """(master fp32, exp_avg, exp_avg_sq) views of a chunk's fp32 state blob.

    Raises:
        Nothing.
    """
    moments = blob[numel:].view(moments_dtype).view(2, numel)
    return blob[:numel], moments[0], moments[1]


def chunk_state_bytes(numel: int, moments_dtype: torch.dtype) -> int:
    """Bytes of the state blob of a chunk of ``numel`` elements in the store (4 KiB blocks).

    Raises:
        Nothing.
    """
    return block_bytes(4 * state_numel(numel, moments_dtype))


def gpu_side_state_bytes(numel: int, param_dtype: torch.dtype, moments_dtype: torch.dtype) -> int:
    """Bytes of the GPU-side state of ``numel`` params of ``param_dtype``: both moments in
    ``moments_dtype`` (``2·m`` B/param: 8 with fp32, 4 with bf16) plus an fp32 master
    (4 B/param) unless the params are fp32 (then they are their own master). What
    :meth:`StateLayout.gpu_state_bytes` counts and ``tiermem plan`` sizes.

    Args:
        numel: params (elements) kept on the GPU side.
        param_dtype: the params' ``torch.dtype``.
        moments_dtype: HybridAdam's ``moments_dtype`` (``torch.float32`` or ``torch.bfloat16``).

    Raises:
        Nothing: plain arithmetic.
    """
    master = 0 if param_dtype == torch.float32 else 4
    return numel * (2 * moments_dtype.itemsize + master)


def wide_batches(numels: list[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """Tensors of ``numels`` elements, in order, in batches of at most ``limit`` elements: each
    batch a list of ``(tensor index, lo, hi)`` slices; a tensor longer than ``limit`` is cut at
    multiples of ``limit`` from its start, shorter ones share a batch.

    Raises:
        Nothing.
    """
    batches: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    size = 0
    for j, n in enumerate(numels):
        for lo in range(0, n, limit):
            hi = min(n, lo + limit)
            if batch and size + hi - lo > limit:
                batches.append(batch)
                batch, size = [], 0
            batch.append((j, lo, hi))
            size += hi - lo
    if batch:
        batches.append(batch)
    return batches


def ring_bytes(chunk_numel: int, element_bytes: int) -> int:
    """Pinned bytes of one param group's gradient ring (``GRAD_SLOTS`` chunks) and param-out
    ring (``OUT_SLOTS`` chunks), each rounded up to the store's 4 KiB blocks.

    Args:
        chunk_numel: elements of the group's largest offloaded chunk.
        element_bytes: bytes per element of the group's params (the model dtype).

    Raises:
        Nothing: plain arithmetic.
    """
    return sum(block_bytes(slots * chunk_numel * element_bytes) for slots in (GRAD_SLOTS, OUT_SLOTS))


def nvme_staging_bytes(chunk_numel: int, moments_dtype: torch.dtype, lookahead_chunks: int) -> int:
    """Pinned bytes the NVMe stream stages state in: ``lookahead_chunks`` chunks read ahead
    plus ``NVME_EXTRA_CHUNKS`` (the chunk being stepped, write-backs in flight), each a state
    blob of ``chunk_numel`` elements (12 B/element with fp32 moments, 8 with bf16).

    Args:
        chunk_numel: elements of the largest offloaded chunk.
        moments_dtype: ``torch.float32`` or ``torch.bfloat16``, as HybridAdam's.
        lookahead_chunks: HybridAdam's ``nvme_lookahead_chunks``.

    Raises:
        Nothing: plain arithmetic.
    """
    return chunk_state_bytes(chunk_numel, moments_dtype) * (lookahead_chunks + NVME_EXTRA_CHUNKS)


@dataclass
class Group:
    """Per param group: the split, the GPU-side state and the offloaded side's buffers.

    ``params`` are the user's params; the plan, ``steps`` and every piece index refer to the
    group's *local tensors*: the params themselves (one process), their local shards (FSDP2),
    or the pieces of params in this rank's shard (``segments``, data parallel).
    """

    index: int
    params: list[torch.Tensor]
    plan: GroupPlan
    steps: list[int]
    n_local: int = 0
    segments: list | None = None  # data parallel: distributed.Segment per local tensor
    numels: list[int] = field(default_factory=list)  # per local tensor (for re-planning)
    sizes: list[int] = field(default_factory=list)  # bytes per element, per local tensor
    locals_in_bucket: dict[int, list[int]] = field(default_factory=dict)
    # GPU side, one entry per GPU piece: fp32 masters, moments in HybridAdam's moments_dtype
    gpu_views: list[torch.Tensor] = field(default_factory=list)
    gpu_masters: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    gpu_steps: list[torch.Tensor] = field(default_factory=list)
    # offloaded side
    grad_key: Any = None
    out_key: Any = None
    grad_ring: list = field(default_factory=list)  # GRAD_SLOTS chunk-sized gradient buffers
    grad_next: int = 0
    out_ring: list = field(default_factory=list)  # OUT_SLOTS chunk-sized param-out buffers
    out_events: list = field(default_factory=list)  # last H2D from each slot
    out_next: int = 0
    chunk_keys: list = field(default_factory=list)
    # Note [streamed write-back] (tiermem/optim/streamed.py): local tensor -> its weight
    # stream's host copy, which HybridAdam reads and writes instead of the parameter
    host_copies: dict[int, torch.Tensor] = field(default_factory=dict)


def local_view(g: Group, i: int) -> torch.Tensor:
    """Flat (1-D) view of local tensor ``i`` of group ``g``: what this rank updates.

    Raises:
        Nothing.
    """
    host = g.host_copies.get(i)
    if host is not None:
        return host.view(-1)
    if g.segments is not None:
        s = g.segments[i]
        return g.params[s.param].detach().view(-1)[s.start:s.start + s.numel]
    return local_of(g.params[i]).view(-1)


def param_index(g: Group, i: int) -> int:
    """Index in ``g.params`` of the param local tensor ``i`` belongs to.

    Raises:
        Nothing.
    """
    return g.segments[i].param if g.segments is not None else i


def runs(group: Group, chunk: Chunk, has_grad: dict) -> list[tuple[int, int, int]]:
    """(start in chunk, numel, step) runs of consecutive pieces that have gradients.

    Raises:
        Nothing.
    """
    out: list[list[int]] = []
    for pc in chunk.pieces:
        if not has_grad[pc.param]:
            continue
        step = group.steps[pc.param] + 1
        start = pc.flat_offset - chunk.flat_start
        if out and out[-1][2] == step and out[-1][0] + out[-1][1] == start:
            out[-1][1] += pc.numel
        else:
            out.append([start, pc.numel, step])
    return [tuple(r) for r in out]


def execution_order(g: Group, arrived: dict[tuple[int, int], int]) -> list[int]:
    """Group ``g``'s local tensors in execution order: reverse gradient arrival (the last
    gradient belongs to the first layer); tensors without a gradient last, as given. The
    given order when nothing was recorded or the group mixes dtypes (the split is by bytes,
    so another order could change how many elements are offloaded).

    Raises:
        Nothing.
    """
    seen = sorted((rank, i) for (gi, i), rank in arrived.items() if gi == g.index)
    if not seen or len(set(g.sizes)) > 1:
        return list(range(g.n_local))
    order = [i for _, i in reversed(seen)]
    got = set(order)
    return order + [i for i in range(g.n_local) if i not in got]


def host_bytes(groups: list[Group], moments_dtype: torch.dtype,
               lookahead_chunks: int) -> tuple[int, int, int]:
    """Bytes the offloaded side needs: ``(pinned gradient and param-out rings, state of all
    chunks, NVMe staging: lookahead_chunks + NVME_EXTRA_CHUNKS chunk blobs)``.

    Raises:
        Nothing.
    """
    chunks = [c for g in groups for c in g.plan.chunks]
    rings = sum(ring_bytes(max(c.numel for c in g.plan.chunks), g.sizes[0])
                for g in groups if g.plan.chunks)
    state = sum(chunk_state_bytes(c.numel, moments_dtype) for c in chunks)
    staging = nvme_staging_bytes(max(c.numel for c in chunks), moments_dtype,
                                 lookahead_chunks) if chunks else 0
    return rings, state, staging


def private_store(groups: list[Group], *, chunk_numel: int, moments_dtype: torch.dtype,
                  lookahead_chunks: int, state_tier: str, device: torch.device,
                  nvme_dir: str | None) -> TierStore:
    """A TierStore sized for this state alone: the rings, and the state (``"cpu"``) or the
    NVMe staging in RAM and the state in spill files under ``nvme_dir``.

    Raises:
        ValueError: the store refuses the sizes or ``nvme_dir``.
        OSError: the spill directory cannot be made.
    """
    buf_bytes, state_bytes, staging = host_bytes(groups, moments_dtype, lookahead_chunks)
    chunk_bytes = chunk_state_bytes(chunk_numel, moments_dtype)
    if state_tier == "cpu":
        cpu_bytes = buf_bytes + state_bytes
        nvme_bytes = 0
    else:
        cpu_bytes = buf_bytes + staging
        # slack: chunk extents are freed on read and reallocated on write-back
        nvme_bytes = state_bytes + staging
    # slabs hold a whole number of chunks; slack for the buffers' partial slabs
    slab_bytes = chunk_bytes * max(1, (1 << 30) // chunk_bytes)
    cpu_bytes += 2 * chunk_bytes
    return TierStore(StoreConfig(
        gpu_bytes=0, cpu_bytes=cpu_bytes, nvme_bytes=nvme_bytes,
        nvme_dir=nvme_dir if nvme_bytes else None, device=str(device),
        pool_slab_bytes=min(slab_bytes, cpu_bytes)))


class StateLayout:
    """HybridAdam's state and where it lives: the groups (GPU side, pinned rings, chunk keys),
    which chunks stream through NVMe, which RAM chunks are held for good; allocates it, frees
    a failed allocation, and re-plans the split from a recorded gradient order.

    Attributes:
        groups: the :class:`Group` of every param group (shared with HybridAdam).
        store: the TierStore holding the rings and the offloaded chunks.
        nvme_chunks: ``(group, chunk)`` streamed through NVMe.
        ram_held: with ``state_tier="split"``, the keys of chunks held in the cpu tier for good
            (also the finalizer's list: cleared, never replaced).
    """

    def __init__(self, groups: list[Group], store: TierStore, *, owner: int,
                 device: torch.device, state_tier: str, moments_dtype: torch.dtype,
                 backward_order: bool, nvme_lookahead_chunks: int, offload_fraction: float,
                 chunk_numel: int) -> None:
        """Args: ``owner`` (the optimizer's number, unique in the process, in every store key
        it makes: Note [lifetime]), ``backward_order`` (chunks are stepped in the order their
        gradients complete, else in forward order: Note [stepping order] in hybrid_adam.py) and
        the HybridAdam arguments of the same names; allocates nothing (see :meth:`alloc`).

        Raises:
            Nothing: the arguments were checked by HybridAdam.
        """
        self.groups = groups
        self.store = store
        self.owner = owner
        self.device = device
        self.state_tier = state_tier
        self.moments_dtype = moments_dtype
        self.backward_order = backward_order
        self.nvme_lookahead_chunks = nvme_lookahead_chunks
        self.offload_fraction = offload_fraction
        self.chunk_numel = chunk_numel
        self.nvme_chunks: set[tuple[int, int]] = set()
        self.ram_held: list = []
        self.watch: Any = None  # HybridAdam's ParamWatch: every write to a param goes through it

    # ------------------------------------------------------------------ sizing

    def check_room(self) -> None:
        """Refuse, at construction, a store whose free budgets cannot hold the offloaded state
        (a lower bound: pool fragmentation can still make a put fail later).

        Raises:
            ValueError: names the tier, the bytes free and needed, and the fixes.
        """
        if not sum(g.plan.cpu_numel for g in self.groups):
            return
        rings, state, staging = host_bytes(self.groups, self.moments_dtype,
                                           self.nvme_lookahead_chunks)
        cfg = self.store.config
        cpu_free = cfg.cpu_bytes - self.store.used_bytes("cpu")
        nvme_free = cfg.nvme_bytes - self.store.used_bytes("nvme")
        fix = ("raise the store's budgets (StoreConfig.cpu_bytes / nvme_bytes), lower "
               "offload_fraction, use moments_dtype=torch.bfloat16, or state_tier='split'")
        cpu_need = rings + (state if self.state_tier == "cpu" else staging)
        if cpu_need > cpu_free:
            raise ValueError(f"HybridAdam: the store's cpu tier has {cpu_free} bytes free; the "
                             f"offloaded state needs {cpu_need} there (state_tier="
                             f"{self.state_tier!r}, pinned rings and staging included): {fix}")
        nvme_room = nvme_free + (cpu_free - cpu_need if self.state_tier == "split" else 0)
        if self.state_tier != "cpu" and state > nvme_room:
            raise ValueError(f"HybridAdam: the store's nvme tier has {nvme_free} bytes free; the "
                             f"offloaded state needs {state} (state_tier={self.state_tier!r}"
                             f"{', RAM included' if self.state_tier == 'split' else ''}): {fix}")

    def gpu_state_bytes(self) -> int:
        """Bytes of the GPU side's state, by :func:`gpu_side_state_bytes` per allocated piece:
        the moments in ``moments_dtype`` (8 B/param with fp32, 4 with bf16), and fp32 masters
        of non-fp32 params (4 B/param); 0 before the state is allocated.

        Raises:
            Nothing.
        """
        return sum(gpu_side_state_bytes(v.numel(), v.dtype, self.moments_dtype)
                   for g in self.groups for v in g.gpu_views)

    def chunk_tiers(self) -> dict[str, int]:
        """Offloaded chunks per tier: ``{"cpu": n, "nvme": n}``.

        Raises:
            Nothing.
        """
        n = sum(len(g.plan.chunks) for g in self.groups)
        return {"cpu": n - len(self.nvme_chunks), "nvme": len(self.nvme_chunks)}

    # ------------------------------------------------------------------ order

    def replan(self, arrived: dict[tuple[int, int], int]) -> None:
        """Re-split every group whose execution order, from the recorded gradient ``arrived``
        order, differs from the given one (Note [trace placement] in state_setup.py).

        Raises:
            Nothing.
        """
        for g in self.groups:
            order = execution_order(g, arrived)
            if order != list(range(g.n_local)):
                g.plan = plan_group(g.numels, g.sizes, self.offload_fraction, self.chunk_numel,
                                    order=order)

    def expected_order(self) -> list[tuple[int, int]]:
        """Chunks in the order they are stepped: the order their gradients complete (reverse
        layer order) with ``backward_order``, else forward order (Note [stepping order] in
        hybrid_adam.py).

        Raises:
            Nothing.
        """
        order = [(g.index, c) for g in self.groups for c in range(len(g.plan.chunks))]
        return order[::-1] if self.backward_order else order

    def nvme_order(self) -> list[tuple[int, int]]:
        """The NVMe-resident chunks in the order they are stepped.

        Raises:
            Nothing.
        """
        return [item for item in self.expected_order() if item in self.nvme_chunks]

    def param_chunks(self) -> dict[int, list[tuple[int, int]]]:
        """``id(param)`` -> the offloaded chunks holding its elements.

        Raises:
            Nothing.
        """
        return {id(g.params[i]): [(g.index, c) for c in dict.fromkeys(chunks)]
                for g in self.groups for i, chunks in g.plan.chunks_of_param.items()}

    def params_per_chunk(self) -> dict[tuple[int, int], int]:
        """``(group, chunk)`` -> how many local tensors' gradients the chunk waits for.

        Raises:
            Nothing.
        """
        return {(g.index, c): len({pc.param for pc in chunk.pieces})
                for g in self.groups for c, chunk in enumerate(g.plan.chunks)}

    def refresh_views(self) -> None:
        """FSDP2 may re-create a sharded param's local tensor (lazy init): re-take the views.

        Raises:
            Nothing.
        """
        for g in self.groups:
            for k, piece in enumerate(g.plan.gpu_pieces):
                view = local_view(g, piece.param)[piece.start:piece.start + piece.numel]
                if g.gpu_masters[k] is g.gpu_views[k]:
                    g.gpu_masters[k] = view
                g.gpu_views[k] = view

    # ------------------------------------------------------------------ allocation

    def chunk_key(self, g: int, c: int) -> tuple:
        """The store key of chunk ``c`` of group ``g``'s state blob.

        Raises:
            Nothing.
        """
        return ("hybrid_adam", self.owner, g, "chunk", c)

    def _chunk_bytes(self, chunk: Chunk) -> int:
        return chunk_state_bytes(chunk.numel, self.moments_dtype)

    def alloc(self) -> None:
        """Allocate the GPU side, the rings and every chunk (logged; a progress bar from
        ``_PROGRESS_MIN_BYTES`` on a terminal). On failure call :meth:`undo`.

        Raises:
            TierFullError: the store has no room for a buffer or a chunk.
            ValueError: a param group mixes dtypes.
        """
        chunks = [c for g in self.groups for c in g.plan.chunks]
        state = sum(map(self._chunk_bytes, chunks))
        if chunks:
            logger.info("HybridAdam: setting up %d chunks (%.2f GiB) of offloaded state in the "
                        "store's %s tier", len(chunks), state / 2**30, self.state_tier)
        bar = progress(len(chunks), "HybridAdam: offloaded state", "chunk") \
            if state >= _PROGRESS_MIN_BYTES else None
        try:
            self._alloc_groups(bar)
            if self.state_tier == "split":
                self._place_split(bar)
        finally:
            if bar is not None:
                bar.close()

    def undo(self) -> None:
        """Free everything a failed :meth:`alloc` made: release what it holds, delete the
        owner's keys from the store, forget the GPU side.

        Raises:
            StoreClosedError: the store was closed.
        """
        self.ram_held.clear()  # the same list as the finalizer's: cleared, not replaced
        free_owner_keys(self.store, self.owner)
        for g in self.groups:
            for name in ("gpu_views", "gpu_masters", "gpu_exp_avg", "gpu_exp_avg_sq",
                         "gpu_steps", "grad_ring", "out_ring", "out_events", "chunk_keys"):
                getattr(g, name).clear()
            g.grad_key = g.out_key = None
        self.nvme_chunks.clear()

    def _alloc_groups(self, bar) -> None:
        """The GPU side of every group (fp32 masters, moments in ``moments_dtype``), its
        gradient and param-out rings and (but with ``state_tier="split"``) its chunks; ``bar``
        counts chunks (None: no bar)."""
        for g in self.groups:
            for piece in g.plan.gpu_pieces:
                local = local_view(g, piece.param)
                view = local[piece.start:piece.start + piece.numel]
                g.gpu_views.append(view)
                g.gpu_masters.append(view if local.dtype == torch.float32 else view.float())
                for moments in (g.gpu_exp_avg, g.gpu_exp_avg_sq):  # a streamed one's: host
                    moments.append(torch.zeros(piece.numel, dtype=self.moments_dtype,
                                               device=view.device))
                g.gpu_steps.append(torch.tensor(0.0, dtype=torch.float32, device=view.device))
            if not g.plan.cpu_numel:
                continue
            dtype = local_view(g, g.plan.cpu_pieces[0].param).dtype
            if any(local_view(g, pc.param).dtype != dtype for pc in g.plan.cpu_pieces):
                mixed = sorted({str(local_view(g, pc.param).dtype) for pc in g.plan.cpu_pieces})
                raise ValueError(f"HybridAdam: param group {g.index} mixes dtypes {mixed}; put "
                                 f"params of different dtypes in different param groups")
            g.grad_key = ("hybrid_adam", self.owner, g.index, "grad")
            g.out_key = ("hybrid_adam", self.owner, g.index, "out")
            slot_numel = max(c.numel for c in g.plan.chunks)
            self.store.put(g.grad_key, torch.empty(GRAD_SLOTS, slot_numel, dtype=dtype), tier="cpu")
            self.store.put(g.out_key, torch.empty(OUT_SLOTS, slot_numel, dtype=dtype), tier="cpu")
            g.grad_ring = list(self.store.get(g.grad_key, "cpu", hold=True))
            g.out_ring = list(self.store.get(g.out_key, "cpu", hold=True))
            g.out_events = [None] * OUT_SLOTS
            for chunk in g.plan.chunks:
                if self.state_tier == "split":
                    continue  # placed below, once every group's buffers are allocated
                key = self.chunk_key(g.index, chunk.index)
                self.store.put(key, self.initial_state(g, chunk), tier=self.state_tier)
                g.chunk_keys.append(key)
                if self.state_tier == "nvme":
                    self.nvme_chunks.add((g.index, chunk.index))
                if bar is not None:
                    bar.update(1)

    def _place_split(self, bar=None) -> None:
        """Note [split tier]: a static placement of the offloaded chunks.

        The CPU step visits every chunk once per step in the same (cyclic) order, so the
        placement that minimises NVMe reads with a RAM budget of ``k`` chunks keeps a fixed set
        of ``k`` chunks in RAM for good (Belady's rule on a cyclic trace: anything cached
        dynamically would be evicted before its reuse). Which ``k``: the chunks stepped *last*
        (in backward order, the first layers, whose gradients arrive at the very end of backward).
        Their CPU step is on the critical path after backward, and a RAM chunk needs no read,
        so the tail is pure compute; the chunks stepped first (the last layers) stream through
        NVMe, and their reads are started when a step begins (``ReadAhead.first_chunks``), i.e.
        hidden behind the forward pass and the backward of the later layers. The budget is what
        the store's ``cpu_bytes`` can still allocate (slab fragmentation included) once the staging room of
        the NVMe stream is reserved (``nvme_lookahead_chunks + 3`` chunks: read-ahead, the chunk
        being stepped, write-backs in flight): RAM takes chunks in that order until a put fails,
        the rest go to NVMe. RAM chunks stay held in the store so its eviction never demotes
        them.
        """
        order = self.expected_order()[::-1]  # RAM preference: the chunk stepped last first
        biggest = max((self._chunk_bytes(ch) for g in self.groups for ch in g.plan.chunks),
                      default=0)
        # the NVMe stream's staging is reserved for real first (the pool's slabs fragment, so
        # counting bytes is not enough), then RAM takes chunks until an allocation fails
        staging = [("hybrid_adam", self.owner, "staging", k)
                   for k in range(self.nvme_lookahead_chunks + NVME_EXTRA_CHUNKS)]
        nvme, held = [], []
        try:
            for key in staging:
                self.store.put(key, torch.empty(biggest, dtype=torch.uint8), tier="cpu")
                self.store.get(key, "cpu", hold=True)  # never evicted to make room for RAM chunks
                held.append(key)
            full = False
            for g, c in order:
                group, chunk = self.groups[g], self.groups[g].plan.chunks[c]
                key = self.chunk_key(g, chunk.index)
                if not full:
                    try:
                        self.store.put(key, self.initial_state(group, chunk), tier="cpu")
                        self.store.get(key, "cpu", hold=True)  # pinned in RAM for good
                        self.ram_held.append(key)
                        if bar is not None:
                            bar.update(1)
                        continue
                    except TierFullError:
                        full = True  # RAM is full: this chunk and the rest go to NVMe
                nvme.append((g, c, key))
        finally:
            for key in held:
                self.store.release(key)
                self.store.delete(key)  # the staging room the NVMe stream needs from now on
        for g, c, key in nvme:
            self.store.put(key, self.initial_state(self.groups[g], self.groups[g].plan.chunks[c]),
                           tier="nvme")
            self.nvme_chunks.add((g, c))
            if bar is not None:
                bar.update(1)
        for g in self.groups:
            g.chunk_keys = [self.chunk_key(g.index, chunk.index) for chunk in g.plan.chunks]

    def initial_state(self, group: Group, chunk: Chunk) -> torch.Tensor:
        """A chunk's fp32 state blob at step 0: the master copied from the params, zero moments.

        Raises:
            Nothing.
        """
        state = torch.zeros(state_numel(chunk.numel, self.moments_dtype))
        master = state[:chunk.numel]
        for pc in chunk.pieces:
            lo = pc.flat_offset - chunk.flat_start
            master[lo:lo + pc.numel].copy_(local_view(group, pc.param)[pc.start:pc.start + pc.numel])
        return state


def free_owner_keys(store: TierStore, owner: int) -> None:
    """Release every hold on, then delete, each key the optimizer numbered ``owner`` made in
    ``store`` (its rings, chunks, staging); keys of anyone else are never touched.

    Raises:
        StoreClosedError: the store is closed.
    """
    for key in store.keys():
        if isinstance(key, tuple) and key[:2] == ("hybrid_adam", owner):
            while True:  # every hold is this optimizer's (rings, RAM chunks, staging)
                try:
                    store.release(key)
                except ValueError:  # not held any more
                    break
            store.delete(key)
