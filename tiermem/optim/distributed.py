"""HybridAdam under torch.distributed: ZeRO-1/2 data parallelism and FSDP2 local shards.

Two ways to use HybridAdam on several ranks (``tiermem.optim.HybridAdam``'s ``data_parallel``,
``process_group`` and the param type choose; see its docstring):

``"zero"`` (``data_parallel=True`` or a ``process_group``; plain, replicated params, no DDP):
    Every rank holds the whole model and computes gradients on its part of the batch. Per param
    group the params' flattened elements, concatenated in the order given, form one flat space
    of ``N`` elements, padded to ``S * world`` with ``S = ceil(N / world)``; rank ``r`` owns
    elements ``[r*S, min(N, (r+1)*S))`` -- element granularity, one param may be cut between two
    ranks, the same partition on every rank. The rank keeps fp32 masters and the moments (in
    ``moments_dtype``, on the GPU side too) only for its shard, split between the GPU and the
    offloaded side by ``offload_fraction`` *within the shard* (the usual
    :func:`tiermem.optim.partition.plan_group` applied to the shard's pieces of params). One
    step:

    1. backward: each param's post-accumulate-grad hook (last micro-batch) copies its gradient
       into the group's flat gradient buffer (model dtype, on the params' device). Buckets of
       consecutive params (``bucket_numel`` elements, formed from the last param backwards, so
       they fill in backward order) are reduced as soon as they are full: one ``reduce`` per
       rank whose shard meets the bucket, to that rank, summed then divided by ``world`` on the
       owner (the gradient average DDP computes). Buckets are launched in one fixed order on
       every rank (a bucket waits for the ones before it), so collectives always match. On CUDA
       the reduces run on a dedicated communication stream, and the owner's offloaded pieces
       go D2H from there as soon as their bucket is reduced, so the CPU step starts during
       backward as on one GPU (Note [hybrid step]).
    2. ``step()``: buckets not launched yet (overlap off, params without gradient) are launched
       in the same fixed order, missing gradients as zeros; one small all-reduce (MAX) of
       per-param "has a gradient" flags tells every rank which params to step (torch skips
       params whose ``grad`` is ``None``; a param with a gradient on some rank only is averaged
       with zeros, like DDP with unused parameters). The rank steps its shard (GPU side with
       torch's fused kernel, CPU side with the native kernel), writes its updated elements into
       the flat buffer and all-gathers it (in place), then copies every param back out.

    Memory per rank: optimizer state for ``1/world`` of the elements; plus one flat buffer of
    ``S * world`` elements per group in the model dtype (gradients during backward, gathered
    params during ``step()``). ``p.grad`` keeps the rank's own, unreduced gradient.

``"fsdp"`` (params are DTensors, e.g. after ``torch.distributed.fsdp.fully_shard``):
    FSDP2 already reduce-scatters gradients into the sharded params' ``.grad`` and all-gathers
    params in forward, so HybridAdam steps each rank's local shard (``p.to_local()``) and
    communicates only for gradient clipping (an all-reduce of the squared norm over the mesh
    dimensions the params are sharded on). FSDP2 writes ``.grad`` directly (no
    post-accumulate-grad hook fires on a sharded param), so gradients go D2H in ``step()``.
    ``state_dict()`` returns DTensor-shaped state (same mesh and placements as the param), so
    ``torch.distributed.checkpoint`` saves one shard per rank and reshards on load (other world
    sizes included).

Everything here is pure bookkeeping or thin wrappers over ``torch.distributed``; the stepping
itself is HybridAdam's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from tiermem.optim.local_tensor import is_dtensor, local_of  # noqa: F401 (re-exported)

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover - torch without distributed support
    dist = None


def dist_ready() -> bool:
    """True when torch.distributed is available and a default process group exists."""
    return dist is not None and dist.is_available() and dist.is_initialized()


def global_rank() -> int | None:
    """This process's rank in the default group, or ``None`` outside torch.distributed."""
    return dist.get_rank() if dist_ready() else None


def rank_prefix(name: str = "HybridAdam") -> str:
    """``"HybridAdam[rank 3]"`` under torch.distributed, else ``"HybridAdam"`` (error prefix)."""
    rank = global_rank()
    return name if rank is None else f"{name}[rank {rank}]"


def rank_dir(base: str) -> str:
    """The per-rank spill directory ``base/rank{r}`` (created), or ``base`` outside distributed.

    Raises:
        OSError: the directory cannot be created.
    """
    rank = global_rank()
    if rank is None:
        return base
    path = os.path.join(base, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- DTensor / FSDP2


def check_fsdp_params(params: list[torch.Tensor], who: str) -> tuple[object, tuple]:
    """Check that all params are DTensors on one mesh with one placement; return both.

    Raises:
        ValueError: a mix of DTensor and plain params, several meshes or placements.
    """
    kinds = {is_dtensor(p) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"{who}: some params are DTensors (FSDP2) and some are plain tensors; "
                         f"shard the whole model with fully_shard, or give the plain params to "
                         f"another optimizer")
    mesh, placements = params[0].device_mesh, tuple(params[0].placements)
    for i, p in enumerate(params):
        if p.device_mesh != mesh or tuple(p.placements) != placements:
            raise ValueError(f"{who}: param {i} is on mesh {p.device_mesh} with placements "
                             f"{tuple(p.placements)} but param 0 on {mesh} with {placements}; "
                             f"HybridAdam needs one mesh and one placement for all params "
                             f"(one HybridAdam per mesh)")
    return mesh, placements


def shard_groups(mesh, placements) -> list:
    """Process groups of the mesh dimensions the params are sharded on (for norm reductions)."""
    from torch.distributed.tensor import Shard
    return [mesh.get_group(d) for d, pl in enumerate(placements) if isinstance(pl, Shard)]


def to_dtensor(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Wrap a local state tensor (shaped like ``param``'s local shard) as a DTensor like ``param``."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def local_state(t: torch.Tensor, param: torch.Tensor, name: str, who: str) -> torch.Tensor:
    """The part of a saved state tensor that belongs to this rank's shard of DTensor ``param``.

    Accepts a DTensor (redistributed to ``param``'s placements if they differ) or a plain
    tensor of the param's global shape (this rank's slice is cut out).

    Raises:
        ValueError: a plain tensor whose shape is not the param's global shape.
    """
    if is_dtensor(t):
        if t.device_mesh != param.device_mesh or tuple(t.placements) != tuple(param.placements):
            t = t.redistribute(param.device_mesh, param.placements)
        return t.to_local()
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(f"{who}.load_state_dict: {name} has shape {tuple(t.shape)} but the "
                         f"param's global shape is {tuple(param.shape)}; pass the full tensor or "
                         f"a DTensor (as state_dict() returns and torch.distributed.checkpoint "
                         f"loads)")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return t[index]


# ---------------------------------------------------------------------------- ZeRO bookkeeping


@dataclass(frozen=True)
class Segment:
    """The part of param ``param`` (elements ``[start, start+numel)``) in this rank's shard;
    ``flat_offset`` is its first element in the group's flat space."""

    param: int
    start: int
    numel: int
    flat_offset: int


@dataclass(frozen=True)
class Bucket:
    """Params ``params`` (consecutive), elements ``[lo, hi)`` of the group's flat space."""

    index: int
    params: tuple[int, ...]
    lo: int
    hi: int


def shard_bounds(total: int, world: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, shard_numel)``: rank ``rank``'s elements of a flat space of ``total``.

    ``shard_numel = ceil(total / world)`` (the padded size every rank communicates);
    ``[start, end)`` is clipped to ``total`` (the last ranks may own fewer, or no, elements).
    """
    size = -(-total // world) if total else 0
    start = min(total, rank * size)
    return start, min(total, start + size), size


def shard_segments(numels: list[int], start: int, end: int) -> list[Segment]:
    """The non-empty pieces of params (in order) that fall in flat elements ``[start, end)``."""
    out, offset = [], 0
    for i, n in enumerate(numels):
        lo, hi = max(offset, start), min(offset + n, end)
        if lo < hi:
            out.append(Segment(i, lo - offset, hi - lo, lo))
        offset += n
    return out


def plan_buckets(numels: list[int], bucket_numel: int) -> list[Bucket]:
    """Cut params into buckets of >= ``bucket_numel`` elements (a big param is a bucket alone),
    from the last param backwards; returned in that (launch) order."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    buckets, cur, size = [], [], 0
    for i in reversed(range(len(numels))):
        cur.append(i)
        size += numels[i]
        if size >= bucket_numel:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return [Bucket(k, tuple(sorted(b)), offsets[min(b)], offsets[max(b) + 1])
            for k, b in enumerate(buckets)]


@dataclass
class _ZGroup:
    numels: list[int]
    offsets: list[int]
    total: int
    shard: int  # padded shard size S
    start: int
    end: int
    segments: list[Segment]
    buckets: list[Bucket]
    bucket_of: dict[int, int]
    flat: torch.Tensor | None  # S * world elements, model dtype


class ZeroComm:
    """The communication side of ZeRO-style HybridAdam: flat gradient buffers, bucketed
    reduces to the owning rank, the has-gradient flags and the final in-place all-gather.

    Args:
        groups: the params of each param group (plain tensors, same dtype within a group).
        process_group: the data-parallel group (``None``: the default group).
        bucket_numel: elements per reduce bucket.
        device: the params' device (flat buffers and flag tensors live there).
        who: error-message prefix.

    Raises:
        ValueError: a group mixing dtypes, or ranks whose params differ in size.
    """

    def __init__(self, groups: list[list[torch.Tensor]], process_group, bucket_numel: int,
                 device: torch.device, who: str) -> None:
        self.pg = process_group if process_group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.pg)
        self.rank = dist.get_rank(self.pg)
        self.device = device
        self.who = who
        self.groups: list[_ZGroup] = []
        for gi, params in enumerate(groups):
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise ValueError(f"{who}: param group {gi} mixes dtypes {sorted(map(str, dtypes))}; "
                                 f"with data_parallel every group is one flat buffer: put params "
                                 f"of different dtypes in different param groups")
            numels = [p.numel() for p in params]
            offsets = [0]
            for n in numels:
                offsets.append(offsets[-1] + n)
            total = offsets[-1]
            start, end, shard = shard_bounds(total, self.world, self.rank)
            buckets = plan_buckets(numels, bucket_numel)
            flat = (torch.zeros(shard * self.world, dtype=params[0].dtype, device=device)
                    if params else None)
            self.groups.append(_ZGroup(numels, offsets, total, shard, start, end,
                                       shard_segments(numels, start, end), buckets,
                                       {i: b.index for b in buckets for i in b.params}, flat))
        self._check_same_model()
        # fixed launch order, the same on every rank: last group first, buckets as planned
        self.order = [(g, b.index) for g in reversed(range(len(self.groups)))
                      for b in self.groups[g].buckets]
        self.position = {item: k for k, item in enumerate(self.order)}
        self._flag_offsets = [0]
        for zg in self.groups:
            self._flag_offsets.append(self._flag_offsets[-1] + len(zg.numels))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()  # launches in order, one thread at a time
        self.begin_step()

    def _check_same_model(self) -> None:
        sizes = torch.tensor([zg.total for zg in self.groups] + [len(self.groups)],
                             dtype=torch.int64, device=self.device)
        lo, hi = sizes.clone(), sizes.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.pg)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.pg)
        if not torch.equal(lo, hi):
            raise ValueError(f"{self.who}: the ranks of the process group pass different params "
                             f"(elements per group: this rank {sizes[:-1].tolist()}, min "
                             f"{lo[:-1].tolist()}, max {hi[:-1].tolist()}); every data-parallel "
                             f"rank must build the same model and param groups")

    # ------------------------------------------------------------------ per step

    def begin_step(self) -> None:
        """Forget the last step's arrivals (called after every ``step()``)."""
        self.arrived: set[tuple[int, int]] = set()
        self._with_grad: set[tuple[int, int]] = set()
        self.missing = {(g, b.index): len(b.params) for g, zg in enumerate(self.groups)
                        for b in zg.buckets}
        self.ready: set[tuple[int, int]] = set()
        self.next = 0
        self.flags: torch.Tensor | None = None
        self.changed_any = False  # set by flush

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run the enclosed work on the communication stream (CUDA), after the caller's work."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def join_stream(self) -> None:
        """Make the caller's stream wait for the communication stream (no-op on CPU)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def grad_arrived(self, g: int, i: int, grad: torch.Tensor | None) -> list[tuple[int, int]]:
        """Copy param ``i``'s gradient into the flat buffer; launch the buckets that can go.

        Returns the ``(group, bucket)`` launched (their owner's shard holds the averaged
        gradient once the caller's stream or the communication stream reaches this point).
        """
        with self._lock:
            if (g, i) in self.arrived:
                return []
            self.arrived.add((g, i))
            zg = self.groups[g]
            dst = zg.flat[zg.offsets[i]:zg.offsets[i + 1]]
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.detach().reshape(-1))
                self._with_grad.add((g, i))
            b = zg.bucket_of[i]
            self.missing[(g, b)] -= 1
            if self.missing[(g, b)] == 0:
                self.ready.add((g, b))
            launched = []
            while self.next < len(self.order) and self.order[self.next] in self.ready:
                self._launch(*self.order[self.next])
                launched.append(self.order[self.next])
                self.next += 1
            return launched

    def _launch(self, g: int, b: int) -> None:
        zg = self.groups[g]
        bucket = zg.buckets[b]
        with self.on_stream():
            works = []
            for r in range(self.world):
                lo, hi = max(bucket.lo, r * zg.shard), min(bucket.hi, (r + 1) * zg.shard)
                if lo < hi:
                    dst = dist.get_global_rank(self.pg, r) if self.pg is not dist.group.WORLD else r
                    works.append(dist.reduce(zg.flat[lo:hi], dst=dst, op=dist.ReduceOp.SUM,
                                             group=self.pg, async_op=True))
            for w in works:
                w.wait()  # gloo: blocks; NCCL: the communication stream waits
            lo, hi = max(bucket.lo, zg.start), min(bucket.hi, zg.end)
            if lo < hi and self.world > 1:
                zg.flat[lo:hi].div_(self.world)

    def flush(self, grads, changed: bool = False) -> list[tuple[int, int]]:
        """Launch every bucket not launched yet, in order, taking missing gradients from
        ``grads(g, i)`` (``None``: zeros); then agree on which params have a gradient and
        whether some rank's gradient ``changed`` after its bucket was filled (``changed_any``:
        Note [reduced gradients untouched] in dist_modes.py), in the same all-reduce.

        Returns the buckets launched here.
        """
        launched = []
        for g, zg in enumerate(self.groups):
            for i in range(len(zg.numels)):
                if (g, i) not in self.arrived:
                    launched += self.grad_arrived(g, i, grads(g, i))
        flags = torch.zeros(self._flag_offsets[-1] + 1, dtype=torch.int32, device=self.device)
        have = [self._flag_offsets[g] + i for g, i in sorted(self._with_grad)]
        if have:
            flags[torch.tensor(have, device=self.device)] = 1
        flags[-1] = int(changed)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        self.flags = flags.cpu()
        self.changed_any = bool(self.flags[-1])
        return launched

    def any_failed(self, failed: bool) -> bool:
        """Whether any rank reports a failed step (a MAX all-reduce), so that no rank waits
        in the all-gather for a rank that gave up."""
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(flag.item())

    def has_grad(self, g: int, i: int) -> bool:
        """Whether param ``i`` of group ``g`` has a gradient on some rank this step (after
        :meth:`flush`)."""
        return bool(self.flags[self._flag_offsets[g] + i])

    def shard_grad(self, g: int, seg: int) -> torch.Tensor:
        """The averaged gradient of this rank's segment ``seg`` of group ``g`` (a flat view)."""
        zg = self.groups[g]
        s = zg.segments[seg]
        return zg.flat[s.flat_offset:s.flat_offset + s.numel]

    def gather(self, locals_of) -> None:
        """All-gather the updated shards and copy them into the params.

        ``locals_of(g)`` gives the flat views of this rank's segments of group ``g`` (updated
        in place by the step) and the group's params.
        """
        for g, zg in enumerate(self.groups):
            if zg.flat is None or not zg.total:
                continue
            segs, params = locals_of(g)
            for s, view in zip(zg.segments, segs):
                zg.flat[s.flat_offset:s.flat_offset + s.numel].copy_(view)
            mine = zg.flat[self.rank * zg.shard:(self.rank + 1) * zg.shard]
            if self.world > 1:
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(zg.flat, mine, group=self.pg)  # in place: mine is a view of the output
            for i, p in enumerate(params):
                p.detach().view(-1).copy_(zg.flat[zg.offsets[i]:zg.offsets[i + 1]])

