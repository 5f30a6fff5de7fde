"""HybridAdam: Adam/AdamW whose state is split between the GPU and pinned host RAM or NVMe.

A ``torch.optim.Optimizer``: LR schedulers, ``zero_grad``, param groups and ``state_dict`` work
as usual. Per param group, the first ``1 - offload_fraction`` of the bytes (execution order: the
first layers) keep fp32 masters and moments on the GPU and step there with torch's fused Adam;
the rest (the offloaded side) keeps them in the TierStore's ``"cpu"`` tier (pinned) or streams
them through its ``"nvme"`` tier, and steps on the CPU with tiermem's native kernel.

How one step overlaps (``overlap=True``), see Note [hybrid step]:
1. backward: a post-accumulate-grad hook hands each offloaded gradient to the CPU side as soon
   as it is accumulated (last micro-batch only), with an event marking it complete;
2. a worker thread steps each offloaded chunk on the CPU as soon as all its gradients are
   complete (gradients arrive last-layer-first, so the later layers' chunks step during
   backward): it copies the chunk's gradients D2H on a dedicated stream into a small pinned
   ring (the next chunk's copy runs while this one steps; the gradients wait on the GPU, so
   host staging is a few chunks, not 2 bytes per offloaded param), writes the updated params in
   the model dtype into a pinned ring in the same pass, and copies them H2D on their own stream
   straight into the parameters;
3. ``step()`` steps the GPU side, waits for the worker, and makes the caller's stream wait on
   the H2D copies (no device-wide synchronisation). With ``param_sync="forward"`` it returns
   without waiting: the next forward waits, module by module, only for the chunks of the params
   that module uses (see Note [forward sync]), so the CPU step of the last layers' chunks
   overlaps the first layers' forward.

Note [forward sync]: after such a ``step()``, a global forward pre-hook makes each module wait
(host: until the worker has stepped the chunks holding its params and issued their H2D;
stream: on those copies' events) before it runs. Everything else that reads the params or the
state completes the step first: the next ``step()``, the next backward's first gradient hook,
``state_dict``/``load_state_dict``, ``synchronize()``, ``close`` and ``zero_grad(set_to_none=
False)`` (which overwrites gradients the CPU side may not have copied yet). Code that reads a
param outside a module's forward (an EMA, logging a norm) or writes a gradient in place
(``model.zero_grad(set_to_none=False)``) must call ``opt.synchronize()`` first.
One process only (data parallel all-gathers the updated shards in ``step()``; FSDP2 gathers
params in its own pre-forward hooks).

Note [hybrid step]: a parameter's post-accumulate-grad hook fires after every use of that
parameter in the current backward has been enqueued; the event it records there is what the
D2H copy waits for, and the worker waits for the D2H to finish before stepping, so the H2D that
overwrites the parameter can never race with backward reading it. Gradient clipping needs the
global norm before any update, so with ``max_grad_norm`` no gradient is copied before
``step()`` has clipped them all on the GPU (the copies then wait for the clip).

Note [trace placement]: which elements keep their state on the GPU follows the execution
order, and with ``placement="trace"`` (default; one process, overlap on, ``offload_fraction >
0``) that order is taken from the first backward rather than assumed from the order the params
were given in: the first backward only records the order in which gradients arrive (nothing is
stepped early), and the first ``step()`` builds the partition from it -- the params whose
gradients arrive last (the first layers) keep their state on the GPU, the chunks follow the
arrival order -- and only then allocates the state (masters copied from the params, moments
zero: nothing has been updated yet, so no state moves). That first step is therefore not
overlapped. Anything that needs the state before the first ``step()`` (``state_dict``,
``load_state_dict``, ``memory_bytes``, ``chunk_tiers``) fixes the partition then, from the
gradients seen so far or else the given order. ``placement="given"``: the given order, state
allocated at construction.

Note [gpu lane]: the CPU kernel is bound by host memory bandwidth (~28 bytes per param and step:
fp32 master and moments read and written, bf16 gradient in, bf16 param out), while the GPU's
copy engines reach host memory over PCIe on their own. With ``gpu_step_fraction > 0`` a share of
the offloaded chunks (spread evenly over the order they are stepped in) is stepped by the GPU
instead: the worker issues the chunk's state blob H2D into one of ``_LANE_SLOTS`` device slots
(after the slot's previous write-back), and on a lane stream that waits for the load and the
gradients' events, widens the chunk's gradients to fp32 where backward left them, runs torch's
fused Adam on the chunk's runs (the same kernel as the GPU side), casts the updated params into
the model and records the event forward and ``step()`` wait on; the state then goes D2H back
into its blob. The worker does not wait: it goes on to the next chunk, and releases a lane
chunk's blob (counting it done for ``step()``) only when its write-back has finished. The state
never lives on the GPU: it stays in the store's cpu tier (or streams through nvme) between
steps. Gradients of lane chunks never leave the GPU and their params are not copied H2D.

Several ranks (torch.distributed), see ``tiermem/optim/distributed.py`` for the full design:
- ``data_parallel=True`` (or ``process_group=pg``), plain replicated params, no DDP wrapper:
  ZeRO-1/2. Each rank owns ``1/world`` of every param group's flattened elements and keeps
  optimizer state only for them (split GPU / offloaded by ``offload_fraction`` within the
  shard); gradients are reduced to their owner in buckets from the grad hooks (average, like
  DDP), the owner steps its shard, and the updated shards are all-gathered in ``step()``.
- FSDP2 (params are DTensors after ``fully_shard``): every rank steps its local shard, FSDP does
  the communication; ``max_grad_norm`` all-reduces the squared norm; ``state_dict()`` returns
  DTensors for ``torch.distributed.checkpoint``.
Spill directories are per rank (``nvme_dir/rank{r}``) and errors name the rank.

Note [lifetime]: nothing long-lived refers to the optimizer strongly. The CPU worker thread
waits for work through a weak reference (it holds the optimizer only while it steps a chunk),
and the gradient and forward hooks call it through weak references, so dropping the last
reference collects it even while the model lives on. Its ``weakref.finalize`` (also run by
``close()`` and at interpreter exit) stops the worker, removes the hooks, releases held RAM
chunks and closes a private store, which removes its spill directory and I/O threads. In a
child forked from the process that made it, ``step()``, ``state_dict()`` and
``load_state_dict()`` refuse (the worker thread does not exist there).
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from contextlib import nullcontext as _nullcontext
from typing import Any, Iterable

import torch

from tiermem._log import logger, progress
from tiermem.config import StoreConfig
from tiermem.optim import distributed as _dist
from tiermem.optim.cpu_adam import adam_step_unchecked
from tiermem.optim.partition import Chunk, GroupPlan, auto_chunk_numel, plan_group
from tiermem.store.pool import round_up
from tiermem.store.store import TierFullError, TierStore
from tiermem.store.transfer import Copier


_OUT_SLOTS = 4
"""Chunk-sized pinned buffers the CPU step writes updated params into before their H2D copy:
a ring, so param staging costs 4 chunks instead of 2 bytes per offloaded bf16 param."""

_LANE_SLOTS = 3
"""Device slots of the GPU lane (Note [gpu lane]): one chunk's state loading, one stepping, one
writing back."""

_GRAD_SLOTS = 2
"""Chunk-sized pinned buffers a chunk's gradients are copied into just before it steps: the one
being stepped and the next one's copy in flight."""

_STOP = object()
"""Tells the CPU worker to exit."""

_PROGRESS_MIN_BYTES = 1 << 30
"""Offloaded state of at least this many bytes shows a progress bar while it is set up (on a
terminal; ~4 s per GiB on the H200 host, 54-82 s at 13B-20B); smaller set-ups show none."""


def _state_numel(numel: int, moments_dtype: torch.dtype) -> int:
    """fp32 elements of one chunk's state blob: the master, then both moments."""
    return numel * (3 if moments_dtype == torch.float32 else 2)


def _state_views(blob: torch.Tensor, numel: int, moments_dtype: torch.dtype):
    """(master fp32, exp_avg, exp_avg_sq) views of a chunk's fp32 state blob."""
    moments = blob[numel:].view(moments_dtype).view(2, numel)
    return blob[:numel], moments[0], moments[1]


def _fused_adam_(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list,
                 hp: dict) -> None:
    """torch's fused Adam/AdamW (``hp``: a param group's hyper-parameters) on fp32 tensors, in
    place, on the current stream; ``steps`` are the already incremented step tensors.

    Raises:
        RuntimeError: this torch has no fused Adam op (torch < 2.4).
    """
    fused = getattr(torch, "_fused_adamw_" if hp["adamw"] else "_fused_adam_", None)
    if fused is None:
        raise RuntimeError("HybridAdam needs torch._fused_adamw_ (torch >= 2.4)")
    beta1, beta2 = hp["betas"]
    fused(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=hp["lr"], beta1=beta1, beta2=beta2,
          weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=False,
          maximize=hp["maximize"], grad_scale=None, found_inf=None)


@dataclass
class _Group:
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
    segments: list | None = None  # data parallel: _dist.Segment per local tensor
    numels: list[int] = field(default_factory=list)  # per local tensor (for re-planning)
    sizes: list[int] = field(default_factory=list)  # bytes per element, per local tensor
    locals_in_bucket: dict[int, list[int]] = field(default_factory=dict)
    # GPU side, one entry per GPU piece
    gpu_views: list[torch.Tensor] = field(default_factory=list)
    gpu_masters: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    gpu_steps: list[torch.Tensor] = field(default_factory=list)
    # offloaded side
    grad_key: Any = None
    out_key: Any = None
    grad_ring: list = field(default_factory=list)  # _GRAD_SLOTS chunk-sized gradient buffers
    grad_next: int = 0
    out_ring: list = field(default_factory=list)  # _OUT_SLOTS chunk-sized param-out buffers
    out_events: list = field(default_factory=list)  # last H2D from each slot
    out_next: int = 0
    chunk_keys: list = field(default_factory=list)


class HybridAdam(torch.optim.Optimizer):
    """Adam/AdamW with a fraction of its state off the GPU (pinned RAM or NVMe).

    Args:
        params: parameters or param groups, in execution (forward) order; all on one device.
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        weight_decay: decay coefficient; decoupled (AdamW) when ``adamw``, else L2 (Adam).
        adamw: decoupled weight decay (torch.optim.AdamW) or L2 penalty (torch.optim.Adam).
        maximize: maximize the objective.
        offload_fraction: fraction of each group's parameter bytes whose fp32 master and
            moments live off the GPU, in [0.0, 1.0]; the last layers are offloaded first.
        state_tier: ``"cpu"`` (pinned host RAM), ``"nvme"`` (streamed through the store) or
            ``"split"``: a static placement by the store's cpu budget, see Note [split tier]
            (needs ``store`` with an nvme tier).
        store: the TierStore to keep offloaded state in; ``None`` makes a private one sized for
            this optimizer (``state_tier="nvme"`` then needs ``nvme_dir``).
        nvme_dir: spill directory of the private store (with ``state_tier="nvme"``).
        overlap: step offloaded chunks during backward as their gradients land (else all at
            ``step()``).
        chunk_numel: elements per offloaded chunk (the unit of the CPU step and NVMe I/O);
            ``None``: 1/32 of the offloaded elements rounded down to a power of two, within
            [2^16, 2^24] (per-chunk costs vanish in 16M chunks, while 32 chunks keep the CPU
            step overlapping backward).
        max_grad_norm: clip gradients to this global 2-norm in ``step()`` (correct for grads
            already copied off the GPU); ``None``: no clipping.
        grad_accumulation_steps: backward passes per optimizer step; gradients are copied off
            the GPU only in the last one.
        moments_dtype: dtype of the offloaded side's moments: ``torch.float32`` (exact torch
            semantics) or ``torch.bfloat16`` (half the state bytes, a deliberate precision trade:
            moments are rounded to bf16 after each update; the GPU side keeps fp32).
        cpu_threads: threads of the CPU step (``None``: ``torch.get_num_threads()``, less one
            with overlap on CUDA so backward's kernel launches keep a core).
        nvme_lookahead_chunks: chunks of NVMe state read ahead of the CPU step.
        data_parallel: shard the optimizer state across the ranks of ``process_group``
            (ZeRO-1/2: gradients reduced to their owner, each rank steps ``1/world`` of every
            group's elements, updated params all-gathered in ``step()``). Use it on a plain,
            replicated model *instead of* DDP; every rank must build the same model and groups.
            ``None`` (default): on when ``process_group`` is given. Not with FSDP2 params
            (DTensors), which are detected and stepped per local shard automatically.
        process_group: the data-parallel group (``None`` with ``data_parallel=True``: the
            default group). torch.distributed must be initialized.
        bucket_numel: elements per gradient-reduce bucket with ``data_parallel`` (buckets are
            reduced from the grad hooks as they fill).
        placement: ``"trace"`` (default): the GPU/offloaded split follows the gradient arrival
            order seen in the first backward, see Note [trace placement]; ``"given"``: the
            params' order as given (first ``1 - offload_fraction`` of the bytes on the GPU).
        gpu_step_fraction: share of the offloaded chunks, in [0.0, 1.0], that the GPU steps by
            streaming their state through it (H2D, torch's fused Adam, D2H back; the state stays
            in the store), spread evenly over the gradient order, while the CPU steps the rest:
            the GPU's copy engines add their bandwidth to the CPU's, see Note [gpu lane].
            Costs ``_LANE_SLOTS`` chunks of state and fp32 gradients in GPU memory.
        param_sync: when the updated offloaded params are waited for: ``"step"`` (default: in
            ``step()``, like any torch optimizer) or ``"forward"`` (in the next forward, per
            module, see Note [forward sync]; one process, CUDA or CPU).

    With ``data_parallel`` or FSDP2, ``step()``, ``state_dict()`` and ``load_state_dict()`` are
    collective: call them on every rank. A private store's spill directory is
    ``nvme_dir/rank{r}``.

    Raises:
        ValueError: a value out of range, an unknown ``state_tier``, NVMe without a spill
            directory, params on several devices or on another device than ``store``, or a
            store without room, ``data_parallel`` without torch.distributed or with FSDP2
            params, ranks passing different params, each naming the field and the fix.
        TypeError: a param that is not a floating-point leaf tensor.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, adamw: bool = True,
                 maximize: bool = False, offload_fraction: float = 1.0, state_tier: str = "cpu",
                 store: TierStore | None = None, nvme_dir: str | None = None, overlap: bool = True,
                 chunk_numel: int | None = None, max_grad_norm: float | None = None,
                 grad_accumulation_steps: int = 1, moments_dtype: torch.dtype = torch.float32,
                 cpu_threads: int | None = None,
                 nvme_lookahead_chunks: int = 2, data_parallel: bool | None = None,
                 process_group: Any = None, bucket_numel: int = 1 << 23,
                 param_sync: str = "step", placement: str = "trace",
                 gpu_step_fraction: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not (isinstance(offload_fraction, (int, float)) and 0.0 <= offload_fraction <= 1.0):
            raise ValueError(f"HybridAdam: offload_fraction={offload_fraction!r} is outside "
                             f"[0.0, 1.0]; it is the fraction of parameter bytes whose optimizer "
                             f"state leaves the GPU (0.0 = none, 1.0 = all)")
        if state_tier not in ("cpu", "nvme", "split"):
            raise ValueError(f"HybridAdam: state_tier={state_tier!r} is unknown; use 'cpu' "
                             f"(pinned RAM), 'nvme' (spill files) or 'split' (RAM up to the "
                             f"store's cpu budget, the rest on NVMe)")
        if state_tier == "split" and (store is None or store.config.nvme_bytes == 0):
            raise ValueError("HybridAdam: state_tier='split' places chunks by the budgets of the "
                             "store you pass: give store=TierStore(StoreConfig(cpu_bytes=..., "
                             "nvme_bytes=..., nvme_dir=...)) with nvme_bytes > 0")
        if state_tier == "nvme" and store is None and not nvme_dir:
            raise ValueError("HybridAdam: state_tier='nvme' needs a spill directory: pass "
                             "nvme_dir='/path/on/ssd' or a store with StoreConfig.nvme_bytes > 0")
        if state_tier == "nvme" and store is not None and store.config.nvme_bytes == 0:
            raise ValueError("HybridAdam: state_tier='nvme' but the store has no nvme tier "
                             "(StoreConfig.nvme_bytes=0); give it nvme_bytes and nvme_dir")
        if chunk_numel is not None and (not isinstance(chunk_numel, int) or chunk_numel < 1024):
            raise ValueError(f"HybridAdam: chunk_numel={chunk_numel!r} must be an int >= 1024 "
                             f"or None (sized from the model)")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"HybridAdam: max_grad_norm={max_grad_norm!r} must be > 0 or None")
        if not isinstance(grad_accumulation_steps, int) or grad_accumulation_steps < 1:
            raise ValueError(f"HybridAdam: grad_accumulation_steps={grad_accumulation_steps!r} "
                             f"must be an int >= 1")
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"HybridAdam: moments_dtype={moments_dtype} is not supported; use "
                             f"torch.float32 or torch.bfloat16")
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"HybridAdam: bucket_numel={bucket_numel!r} must be an int >= 1 "
                             f"(elements per gradient-reduce bucket)")
        if not (isinstance(gpu_step_fraction, (int, float)) and not isinstance(gpu_step_fraction, bool)
                and 0.0 <= gpu_step_fraction <= 1.0):
            raise ValueError(f"HybridAdam: gpu_step_fraction={gpu_step_fraction!r} is outside "
                             f"[0.0, 1.0]; it is the share of the offloaded chunks the GPU steps "
                             f"by streaming their state through it (0.0: the CPU steps all)")
        if placement not in ("trace", "given"):
            raise ValueError(f"HybridAdam: placement={placement!r} is unknown; use 'trace' (the "
                             f"split follows the gradient order of the first backward) or "
                             f"'given' (the order the params were given in)")
        if param_sync not in ("step", "forward"):
            raise ValueError(f"HybridAdam: param_sync={param_sync!r} is unknown; use 'step' "
                             f"(updated params ready when step() returns) or 'forward' (the next "
                             f"forward waits per module)")
        if process_group is not None and data_parallel is False:
            raise ValueError("HybridAdam: process_group is given but data_parallel=False; drop "
                             "process_group, or set data_parallel=True to shard the state over it")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                        adamw=adamw)
        super().__init__(params, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(all_params):
            if not p.is_floating_point():
                raise TypeError(f"HybridAdam: param {i} has dtype {p.dtype}; only floating-point "
                                f"params can be optimized")
        devices = {p.device for p in all_params}
        if len(devices) != 1:
            raise ValueError(f"HybridAdam: params are on several devices {sorted(map(str, devices))}; "
                             f"put the model on one device (use one HybridAdam per device)")
        self.device = devices.pop()
        self._mode, self._who = self._choose_mode(all_params, data_parallel, process_group)
        if param_sync == "forward" and self._mode != "local":
            raise ValueError(f"{self._who}: param_sync='forward' works in one process only; "
                             f"with data_parallel or FSDP2 use param_sync='step'")
        self.param_sync = param_sync
        if store is not None and store.device != self.device:
            raise ValueError(f"HybridAdam: params are on {self.device} but the store's device is "
                             f"{store.device}; make the store with StoreConfig.device="
                             f"{str(self.device)!r}")
        self.offload_fraction = float(offload_fraction)
        self.state_tier = state_tier
        self.overlap = overlap
        self.max_grad_norm = max_grad_norm
        self.grad_accumulation_steps = grad_accumulation_steps
        self.moments_dtype = moments_dtype
        if cpu_threads is None and overlap and self.device.type == "cuda":
            cpu_threads = max(1, torch.get_num_threads() - 1)  # one core launches GPU work
        self.cpu_threads = cpu_threads
        self.nvme_lookahead_chunks = nvme_lookahead_chunks
        self.gpu_step_fraction = float(gpu_step_fraction)
        # Note [gpu lane]: offloaded chunks the GPU steps by streaming their state through it
        self._lane_chunks: set[tuple[int, int]] = set()
        self._lane_state: list[torch.Tensor] = []  # device slots: a chunk's state blob
        self._lane_grad: list[torch.Tensor] = []  # device slots: a chunk's fp32 gradients
        self._lane_free: list = []  # per slot: event after which the slot may be overwritten
        self._lane_next = 0
        self._lane_pending: collections.deque = collections.deque()  # (event, g, c) written back
        self._lane_stream = None
        self._lane_copier: Copier | None = None  # its own H2D/D2H streams (see _init_lane)
        self._zero = None
        self._norm_groups: list = []
        if self._mode == "zero":
            self._zero = _dist.ZeroComm([list(g["params"]) for g in self.param_groups],
                                        process_group, bucket_numel, self.device, self._who)
            self._norm_groups = [self._zero.pg]
        elif self._mode == "fsdp":
            self._norm_groups = _dist.shard_groups(all_params[0].device_mesh,
                                                   tuple(all_params[0].placements))
        self._groups = []
        if chunk_numel is None:
            local = (sum(s.numel for zg in self._zero.groups for s in zg.segments)
                     if self._mode == "zero" else
                     sum(_dist.local_of(p).numel() for p in all_params))
            chunk_numel = auto_chunk_numel(int(local * self.offload_fraction))
        self.chunk_numel = chunk_numel
        for gi, g in enumerate(self.param_groups):
            params = list(g["params"])
            segments = None
            if self._mode == "zero":
                segments = self._zero.groups[gi].segments
                numels = [s.numel for s in segments]
                sizes = [params[s.param].element_size() for s in segments]
            else:
                numels = [_dist.local_of(p).numel() for p in params]
                sizes = [p.element_size() for p in params]
            group = _Group(gi, params, plan_group(numels, sizes, self.offload_fraction, chunk_numel),
                           [0] * len(numels), len(numels), segments, numels=numels, sizes=sizes)
            if segments is not None:
                bucket_of = self._zero.groups[gi].bucket_of
                for li, seg in enumerate(segments):
                    group.locals_in_bucket.setdefault(bucket_of[seg.param], []).append(li)
            self._groups.append(group)
        self._owns_store = store is None
        self._store = store if store is not None else self._make_store(nvme_dir)
        if store is not None:
            self._check_room()
        self._copier = Copier(self.device)
        self._nvme_chunks: set[tuple[int, int]] = set()  # (group, chunk) streamed through NVMe
        self._ram_held: list = []  # split: chunk keys held in the cpu tier for good
        self._stats_lock = threading.Lock()
        self._acc = self._new_stats()
        self._last_stats = self._new_stats()
        self._moved0: dict = {}
        # Note [trace placement]: record the first backward's gradient order, plan at step()
        self._trace_placement = (placement == "trace" and self._mode == "local" and overlap
                                 and self.offload_fraction > 0.0)
        self._arrived: dict[tuple[int, int], int] = {}  # (g, i) -> arrival rank, first backward
        self._state_ready = False
        if not self._trace_placement:
            self._init_state()
            self._state_ready = True
        # cross-thread step state, guarded by _lock (hooks run on autograd threads)
        self._lock = threading.Lock()
        self._acc_count: dict[tuple[int, int], int] = {}
        self._shipped: set[tuple[int, int]] = set()
        self._shipped_versions: dict[tuple[int, int], tuple[int, int]] = {}
        # (g, i) -> (flat gradient, event marking it complete) or None (no gradient this step)
        self._grad_refs: dict[tuple[int, int], tuple | None] = {}
        self._copies: dict[tuple[int, int], tuple] = {}  # worker only: chunks whose D2H is issued
        self._chunk_missing: dict[tuple[int, int], int] = {}
        self._queued: set[tuple[int, int]] = set()
        self._read_ahead: set[tuple[int, int]] = set()  # NVMe chunks prefetched, not yet stepped
        self._order_pos = None  # (expected chunk order, position of each chunk in it)
        self._h2d_events: list = []
        self._errors: list[BaseException] = []
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._compute_allowed = threading.Event()
        self._clip_event: torch.cuda.Event | None = None
        self._frozen_hp: list[dict] | None = None  # set by step(), see there
        # param_sync="forward": a step() whose CPU side may still run (Note [forward sync])
        self._pending = False
        self._chunk_h2d: dict[tuple[int, int], Any] = {}  # stepped chunk -> its last H2D event
        self._chunks_of = self._param_chunks()
        self._queue: queue.Queue = queue.Queue()
        me = weakref.ref(self)  # Note [lifetime]: threads and hooks never keep the optimizer alive
        self._worker = threading.Thread(target=self._work, args=(me, self._queue),
                                        name="tiermem-hybrid-adam", daemon=True)
        self._worker.start()
        self._hooks: list = []  # removed by close() or the finalizer
        if self._mode == "local":
            self._hooks += [  # count backward passes always; ship early only with overlap
                g.params[i].register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, me, "_on_grad", g.index, i))
                for g in self._groups
                for i in (range(g.n_local) if self._trace_placement else g.plan.chunks_of_param)]
        elif self._mode == "zero":  # every gradient goes into a reduce bucket
            self._hooks += [
                p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, me, "_on_grad_dp", g.index, i))
                for g in self._groups for i, p in enumerate(g.params)]
        # FSDP2 assigns the sharded .grad itself: no hook fires, everything ships in step()
        if param_sync == "forward":
            # never traced by torch.compile: a traced hook's waits would happen at compile time
            # only, and a compiled forward would read params the CPU side has not written yet
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
                torch.compiler.disable(functools.partial(_call_weak_forward, me))))
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, self._queue, self._worker, self._hooks,
                                           self._ram_held, self._store, self._owns_store,
                                           self._pid)
        self._begin_step()

    # ------------------------------------------------------------------ modes and local tensors

    @staticmethod
    def _choose_mode(params: list[torch.Tensor], data_parallel: bool | None,
                     process_group: Any) -> tuple[str, str]:
        """``("local" | "zero" | "fsdp", error prefix)``; see the class docstring."""
        dp = bool(data_parallel) or process_group is not None
        if any(_dist.is_dtensor(p) for p in params):
            who = _dist.rank_prefix()
            if dp:
                raise ValueError(f"{who}: the params are DTensors (FSDP2 fully_shard), which FSDP "
                                 f"already shards and reduces; drop data_parallel=True / "
                                 f"process_group: HybridAdam steps each rank's local shard")
            _dist.check_fsdp_params(params, who)
            return "fsdp", who
        if dp:
            if not _dist.dist_ready():
                raise ValueError("HybridAdam: data_parallel=True needs torch.distributed: call "
                                 "torch.distributed.init_process_group(...) on every rank before "
                                 "building the optimizer (or leave data_parallel off)")
            return "zero", _dist.rank_prefix()
        return "local", "HybridAdam"

    def _local(self, g: _Group, i: int) -> torch.Tensor:
        """Flat (1-D) view of local tensor ``i`` of group ``g``: what this rank updates."""
        if g.segments is not None:
            s = g.segments[i]
            return g.params[s.param].detach().view(-1)[s.start:s.start + s.numel]
        return _dist.local_of(g.params[i]).view(-1)

    def _param_of(self, g: _Group, i: int) -> int:
        """Index in ``g.params`` of the param local tensor ``i`` belongs to."""
        return g.segments[i].param if g.segments is not None else i

    def _grad_of(self, g: _Group, i: int) -> torch.Tensor | None:
        """Flat gradient of local tensor ``i`` (data parallel: the averaged shard gradient),
        or ``None`` when it has none this step."""
        if g.segments is not None:
            s = g.segments[i]
            if self._zero.flags is not None and not self._zero.has_grad(g.index, s.param):
                return None
            return self._zero.shard_grad(g.index, i)
        grad = g.params[i].grad
        return None if grad is None else _dist.local_of(grad).view(-1)

    def _has_grad(self, g: _Group, i: int) -> bool:
        if g.segments is not None:
            return self._zero.has_grad(g.index, g.segments[i].param)
        return g.params[i].grad is not None

    def _refresh_views(self) -> None:
        """FSDP2 may re-create a sharded param's local tensor (lazy init): re-take the views."""
        for g in self._groups:
            for k, piece in enumerate(g.plan.gpu_pieces):
                view = self._local(g, piece.param)[piece.start:piece.start + piece.numel]
                if g.gpu_masters[k] is g.gpu_views[k]:
                    g.gpu_masters[k] = view
                g.gpu_views[k] = view

    # ------------------------------------------------------------------ setup

    def _offloaded_numel(self) -> int:
        return sum(g.plan.cpu_numel for g in self._groups)

    def _check_room(self) -> None:
        """Refuse, at construction, a store whose free budgets cannot hold the offloaded state
        (a lower bound: pool fragmentation can still make a put fail later).

        Raises:
            ValueError: names the tier, the bytes free and needed, and the fixes.
        """
        if not self._offloaded_numel():
            return
        rings, state, staging = self._host_bytes()
        cfg = self._store.config
        cpu_free = cfg.cpu_bytes - self._store.used_bytes("cpu")
        nvme_free = cfg.nvme_bytes - self._store.used_bytes("nvme")
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

    def _host_bytes(self) -> tuple[int, int, int]:
        """Bytes the offloaded side needs: ``(pinned gradient and param-out rings, state of all
        chunks, NVMe staging: nvme_lookahead_chunks + 3 chunk blobs)``."""
        chunks = [c for g in self._groups for c in g.plan.chunks]
        rings = sum(round_up(slots * max(c.numel for c in g.plan.chunks) * g.sizes[0])
                    for g in self._groups if g.plan.chunks for slots in (_GRAD_SLOTS, _OUT_SLOTS))
        state = sum(self._chunk_bytes(c) for c in chunks)
        staging = max(map(self._chunk_bytes, chunks), default=0) * (self.nvme_lookahead_chunks + 3)
        return rings, state, staging

    def _make_store(self, nvme_dir: str | None) -> TierStore:
        buf_bytes, state_bytes, staging = self._host_bytes()
        chunk_bytes = round_up(4 * _state_numel(self.chunk_numel, self.moments_dtype))
        if self.state_tier == "nvme" and self._mode != "local":
            nvme_dir = _dist.rank_dir(nvme_dir)  # ranks on one host never share spill files
        if self.state_tier == "cpu":
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
            nvme_dir=nvme_dir if nvme_bytes else None, device=str(self.device),
            pool_slab_bytes=min(slab_bytes, cpu_bytes)))

    def _init_state(self) -> None:
        """Allocate the state (GPU side, store buffers and chunks, the lane's slots); on any
        failure (a full store or disk) undo all of it, so a later call starts afresh.

        Raises:
            TierFullError: the store has no room for a buffer or a chunk.
        """
        try:
            self._alloc_state()
        except BaseException:
            self._undo_state()
            raise

    def _undo_state(self) -> None:
        """Free everything a failed :meth:`_alloc_state` made: release what it holds, delete
        this optimizer's keys from the store, forget the GPU side and the lane."""
        held = [key for g in self._groups
                for key, ring in ((g.grad_key, g.grad_ring), (g.out_key, g.out_ring)) if ring]
        for key in held + list(self._ram_held):
            try:
                self._store.release(key)
            except (KeyError, ValueError):  # already released (e.g. by _place_split)
                pass
        self._ram_held.clear()  # the same list as the finalizer's: cleared, not replaced
        for key in self._store.keys():
            if isinstance(key, tuple) and key[:2] == ("hybrid_adam", id(self)):
                self._store.delete(key)
        for g in self._groups:
            for name in ("gpu_views", "gpu_masters", "gpu_exp_avg", "gpu_exp_avg_sq",
                         "gpu_steps", "grad_ring", "out_ring", "out_events", "chunk_keys"):
                getattr(g, name).clear()
            g.grad_key = g.out_key = None
        self._nvme_chunks.clear()
        self._lane_chunks = set()
        self._lane_state, self._lane_grad, self._lane_free = [], [], []

    def _alloc_state(self) -> None:
        chunks = [c for g in self._groups for c in g.plan.chunks]
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
        self._init_lane()

    def _alloc_groups(self, bar) -> None:
        """The GPU side of every group, its gradient and param-out rings and (but with
        ``state_tier="split"``) its chunks; ``bar`` counts chunks (None: no bar)."""
        for g in self._groups:
            for piece in g.plan.gpu_pieces:
                local = self._local(g, piece.param)
                view = local[piece.start:piece.start + piece.numel]
                g.gpu_views.append(view)
                g.gpu_masters.append(view if local.dtype == torch.float32 else view.float())
                g.gpu_exp_avg.append(torch.zeros(piece.numel, dtype=torch.float32, device=self.device))
                g.gpu_exp_avg_sq.append(torch.zeros(piece.numel, dtype=torch.float32, device=self.device))
                g.gpu_steps.append(torch.tensor(0.0, dtype=torch.float32, device=self.device))
            if not g.plan.cpu_numel:
                continue
            dtype = self._local(g, g.plan.cpu_pieces[0].param).dtype
            if any(self._local(g, pc.param).dtype != dtype for pc in g.plan.cpu_pieces):
                raise ValueError(f"HybridAdam: param group {g.index} mixes dtypes; put params of "
                                 f"different dtypes in different param groups")
            g.grad_key = ("hybrid_adam", id(self), g.index, "grad")
            g.out_key = ("hybrid_adam", id(self), g.index, "out")
            slot_numel = max(c.numel for c in g.plan.chunks)
            self._store.put(g.grad_key, torch.empty(_GRAD_SLOTS, slot_numel, dtype=dtype), tier="cpu")
            self._store.put(g.out_key, torch.empty(_OUT_SLOTS, slot_numel, dtype=dtype), tier="cpu")
            g.grad_ring = list(self._store.get(g.grad_key, "cpu", hold=True))
            g.out_ring = list(self._store.get(g.out_key, "cpu", hold=True))
            g.out_events = [None] * _OUT_SLOTS
            for chunk in g.plan.chunks:
                if self.state_tier == "split":
                    continue  # placed below, once every group's buffers are allocated
                key = self._chunk_key(g.index, chunk.index)
                self._store.put(key, self._initial_state(g, chunk), tier=self.state_tier)
                g.chunk_keys.append(key)
                if self.state_tier == "nvme":
                    self._nvme_chunks.add((g.index, chunk.index))
                if bar is not None:
                    bar.update(1)

    def _chunk_key(self, g: int, c: int) -> tuple:
        """The store key of chunk ``c`` of group ``g``'s state blob."""
        return ("hybrid_adam", id(self), g, "chunk", c)

    def _chunk_bytes(self, chunk: Chunk) -> int:
        return round_up(4 * _state_numel(chunk.numel, self.moments_dtype))

    def _place_split(self, bar=None) -> None:
        """Note [split tier]: a static placement of the offloaded chunks.

        The CPU step visits every chunk once per step in the same (cyclic) order, so the
        placement that minimises NVMe reads with a RAM budget of ``k`` chunks keeps a fixed set
        of ``k`` chunks in RAM for good (Belady's rule on a cyclic trace: anything cached
        dynamically would be evicted before its reuse). Which ``k``: the chunks stepped *last*
        (with overlap, the first layers, whose gradients arrive at the very end of backward).
        Their CPU step is on the critical path after backward, and a RAM chunk needs no read,
        so the tail is pure compute; the chunks stepped first (the last layers) stream through
        NVMe, and their reads are started in ``_begin_step``, i.e. hidden behind the forward
        pass and the backward of the later layers. The budget is what the store's
        ``cpu_bytes`` can still allocate (slab fragmentation included) once the staging room of
        the NVMe stream is reserved (``nvme_lookahead_chunks + 3`` chunks: read-ahead, the chunk
        being stepped, write-backs in flight): RAM takes chunks in that order until a put fails,
        the rest go to NVMe. RAM chunks stay held in the store so its eviction never demotes
        them.
        """
        order = [(g.index, c) for g in self._groups for c in range(len(g.plan.chunks))]
        if not self.overlap:
            order = order[::-1]  # stepped in forward order: the last chunks are stepped last
        # order: RAM preference, first = stepped last
        biggest = max((self._chunk_bytes(ch) for g in self._groups for ch in g.plan.chunks),
                      default=0)
        # the NVMe stream's staging is reserved for real first (the pool's slabs fragment, so
        # counting bytes is not enough), then RAM takes chunks until an allocation fails
        staging = [("hybrid_adam", id(self), "staging", k)
                   for k in range(self.nvme_lookahead_chunks + 3)]
        nvme, held = [], []
        try:
            for key in staging:
                self._store.put(key, torch.empty(biggest, dtype=torch.uint8), tier="cpu")
                self._store.get(key, "cpu", hold=True)  # never evicted to make room for RAM chunks
                held.append(key)
            full = False
            for g, c in order:
                group, chunk = self._groups[g], self._groups[g].plan.chunks[c]
                key = self._chunk_key(g, chunk.index)
                if not full:
                    try:
                        self._store.put(key, self._initial_state(group, chunk), tier="cpu")
                        self._store.get(key, "cpu", hold=True)  # pinned in RAM for good
                        self._ram_held.append(key)
                        if bar is not None:
                            bar.update(1)
                        continue
                    except TierFullError:
                        full = True  # RAM is full: this chunk and the rest go to NVMe
                nvme.append((g, c, key))
        finally:
            for key in held:
                self._store.release(key)
                self._store.delete(key)  # the staging room the NVMe stream needs from now on
        for g, c, key in nvme:
            self._store.put(key, self._initial_state(self._groups[g], self._groups[g].plan.chunks[c]),
                            tier="nvme")
            self._nvme_chunks.add((g, c))
            if bar is not None:
                bar.update(1)
        for g in self._groups:
            g.chunk_keys = [self._chunk_key(g.index, chunk.index) for chunk in g.plan.chunks]

    def _initial_state(self, group: _Group, chunk: Chunk) -> torch.Tensor:
        """A chunk's fp32 state blob at step 0: the master copied from the params, zero moments."""
        state = torch.zeros(_state_numel(chunk.numel, self.moments_dtype))
        master = state[:chunk.numel]
        for pc in chunk.pieces:
            lo = pc.flat_offset - chunk.flat_start
            master[lo:lo + pc.numel].copy_(self._local(group, pc.param)[pc.start:pc.start + pc.numel])
        return state

    def _ensure_state(self) -> None:
        """Note [trace placement]: plan from the recorded gradient order (when there is one)
        and allocate the state, once."""
        if self._state_ready:
            return
        with self._lock:
            arrived = dict(self._arrived)
        for g in self._groups:
            order = self._execution_order(g, arrived)
            if order != list(range(g.n_local)):
                g.plan = plan_group(g.numels, g.sizes, self.offload_fraction, self.chunk_numel,
                                    order=order)
        self._init_state()
        self._state_ready = True
        with self._stats_lock:  # the step's I/O counts from here: allocation is not streaming
            self._moved0 = dict(self._store.stats()["moved_bytes"])
        self._chunks_of = self._param_chunks()
        self._order_pos = None
        with self._lock:
            self._chunk_missing = self._params_per_chunk()
        self._read_first_chunks()

    @staticmethod
    def _execution_order(g: _Group, arrived: dict[tuple[int, int], int]) -> list[int]:
        """Group ``g``'s local tensors in execution order: reverse gradient arrival (the last
        gradient belongs to the first layer); tensors without a gradient last, as given. The
        given order when nothing was recorded or the group mixes dtypes (the split is by bytes,
        so another order could change how many elements are offloaded)."""
        seen = sorted((rank, i) for (gi, i), rank in arrived.items() if gi == g.index)
        if not seen or len(set(g.sizes)) > 1:
            return list(range(g.n_local))
        order = [i for _, i in reversed(seen)]
        got = set(order)
        return order + [i for i in range(g.n_local) if i not in got]

    def _param_chunks(self) -> dict[int, list[tuple[int, int]]]:
        """``id(param)`` -> the offloaded chunks holding its elements."""
        return {id(g.params[i]): [(g.index, c) for c in dict.fromkeys(chunks)]
                for g in self._groups for i, chunks in g.plan.chunks_of_param.items()}

    def chunk_tiers(self) -> dict[str, int]:
        """Offloaded chunks per tier: ``{"cpu": n, "nvme": n}`` (where each one lives for good
        with ``state_tier`` ``"cpu"``, ``"nvme"`` or ``"split"``)."""
        self._ensure_state()
        n = sum(len(g.plan.chunks) for g in self._groups)
        return {"cpu": n - len(self._nvme_chunks), "nvme": len(self._nvme_chunks)}

    # ------------------------------------------------------------------ backward side

    def _on_grad(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of an offloaded param: ship its grad on the last micro-batch."""
        if self._pending:
            self._finish_step()  # a param unused in forward: its previous update completes first
        with self._lock:
            count = self._acc_count.get((g, i), 0) + 1
            self._acc_count[(g, i)] = count
            if not self._state_ready:  # Note [trace placement]: the first backward only records
                self._arrived.setdefault((g, i), len(self._arrived))
                return
            if (not self.overlap or count < self.grad_accumulation_steps or (g, i) in self._shipped
                    or i not in self._groups[g].plan.chunks_of_param):
                return
        self._ship(g, i)

    def _on_grad_dp(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of every param with ``data_parallel``: on the last
        micro-batch, put its gradient in its reduce bucket; ship the shard pieces of the
        buckets that were reduced."""
        with self._lock:
            count = self._acc_count.get((g, i), 0) + 1
            self._acc_count[(g, i)] = count
            if not self.overlap or count < self.grad_accumulation_steps:
                return
        launched = self._zero.grad_arrived(g, i, self._groups[g].params[i].grad)
        self._ship_buckets(launched)

    def _ship_buckets(self, launched: list[tuple[int, int]]) -> None:
        """Ship this rank's offloaded pieces of the reduced buckets ``launched`` (D2H from the
        communication stream, so after the reduce)."""
        if not launched:
            return
        with self._zero.on_stream():
            for g, b in launched:
                group = self._groups[g]
                for li in group.locals_in_bucket.get(b, ()):
                    if li in group.plan.chunks_of_param and (g, li) not in self._shipped:
                        self._ship(g, li)

    def _ship(self, g: int, i: int) -> None:
        """Hand local tensor ``i``'s gradient to the CPU side: keep a reference and an event
        marking it complete on the current stream (its D2H is issued by the worker, see
        ``_copy_grads``), and queue the chunks it completes."""
        group = self._groups[g]
        grad = self._grad_of(group, i)
        ref = None
        if grad is not None:
            ready = None
            if self._copier.cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))  # the D2H waits for the grad
            ref = (grad.detach(), ready)
        ready_chunks = []
        with self._lock:
            if self._mode == "local" and grad is not None:  # see _check_grads_untouched
                self._shipped_versions[(g, i)] = (group.params[i].grad._version,
                                                  group.params[i].grad.data_ptr())
            self._shipped.add((g, i))
            self._grad_refs[(g, i)] = ref
            for c in dict.fromkeys(group.plan.chunks_of_param[i]):
                self._chunk_missing[(g, c)] -= 1
                if self._chunk_missing[(g, c)] == 0:
                    ready_chunks.append((g, c))
        for item in ready_chunks:
            self._enqueue(item)

    def _enqueue(self, item: tuple[int, int]) -> None:
        with self._lock:
            if item in self._queued:
                return
            self._queued.add(item)
            self._outstanding += 1
        self._queue.put(item)

    def _begin_step(self) -> None:
        with self._lock:
            self._acc_count.clear()
            self._shipped.clear()
            self._shipped_versions.clear()
            self._grad_refs.clear()
            self._chunk_h2d.clear()
            self._queued.clear()
            self._h2d_events = []
            self._chunk_missing = self._params_per_chunk()
        self._clip_event = None
        self._frozen_hp = None
        self._copies.clear()  # the worker is idle between steps
        if self._zero is not None:
            self._zero.begin_step()
        if self.max_grad_norm is None:
            self._compute_allowed.set()
        else:
            self._compute_allowed.clear()  # the CPU step needs the global norm first
        with self._stats_lock:
            self._acc = self._new_stats()
            self._moved0 = dict(self._store.stats()["moved_bytes"])
        self._read_first_chunks()

    def _params_per_chunk(self) -> dict[tuple[int, int], int]:
        """``(group, chunk)`` -> how many local tensors' gradients the chunk waits for."""
        return {(g.index, c): len({pc.param for pc in chunk.pieces})
                for g in self._groups for c, chunk in enumerate(g.plan.chunks)}

    def _read_first_chunks(self) -> None:
        """Start reading the first NVMe chunks of the next step (hidden behind its forward)."""
        if self._nvme_chunks:
            first = self._nvme_order()[:self.nvme_lookahead_chunks]
            with self._lock:
                self._read_ahead = set(first)
            for g, c in first:
                self._store.prefetch(self._groups[g].chunk_keys[c], "cpu")

    def _expected_order(self) -> list[tuple[int, int]]:
        """Chunks in the order their gradients complete (reverse layer order with overlap)."""
        order = [(g.index, c) for g in self._groups for c in range(len(g.plan.chunks))]
        return order[::-1] if self.overlap else order

    def _nvme_order(self) -> list[tuple[int, int]]:
        """The NVMe-resident chunks in the order they are stepped."""
        return [item for item in self._expected_order() if item in self._nvme_chunks]

    @staticmethod
    def _new_stats() -> dict:
        return {"cpu_adam_s": 0.0, "worker_s": 0.0, "copy_wait_s": 0.0, "d2h_bytes": 0,
                "h2d_bytes": 0, "stall_s": 0.0, "chunks": 0, "gpu_chunks": 0}

    def step_stats(self) -> dict:
        """Breakdown of the last completed ``step()`` (backward hooks included), reset each step.

        ``cpu_adam_s``: seconds of the CPU Adam kernel summed over chunks (worker thread);
        ``worker_s``: seconds the worker spent on chunks (kernel, copy waits, bookkeeping),
        ``copy_wait_s``: of which waiting for gradient D2H copies and param-out ring slots;
        ``d2h_bytes`` / ``h2d_bytes``: offloaded gradients copied off / updated params copied
        back (for chunks on the GPU lane: their state, both ways); ``gpu_chunks``: chunks the
        GPU lane stepped (Note [gpu lane]); ``nvme_read_bytes`` / ``nvme_write_bytes``: the
        store's nvme->cpu / cpu->nvme traffic during the step (all of the store's traffic, if
        it is shared);
        ``stall_s``: time ``step()`` waited for the CPU worker after stepping the GPU side;
        ``step_s``: wall time of ``step()``; ``chunks``: offloaded chunks stepped.
        """
        with self._stats_lock:
            return dict(self._last_stats)

    # ------------------------------------------------------------------ the CPU worker

    @staticmethod
    def _work(ref: weakref.ref, work: queue.Queue) -> None:
        """The CPU worker thread (Note [lifetime]): holds the optimizer only while it handles
        an item, and waits for the next one through a weak reference, so a dropped optimizer is
        collected and its finalizer's ``_STOP`` ends this thread."""
        nxt = None
        while True:
            opt = ref()
            if opt is None:
                return
            if nxt is None and opt._lane_pending and work.empty():
                opt._reap_lane(block=True)  # nothing else to do: wait for a lane write-back
                continue  # and look at the queue again
            del opt
            item = nxt if nxt is not None else work.get()
            opt = ref()
            if item is _STOP or opt is None:
                while opt is not None and opt._lane_pending:
                    opt._reap_lane(block=True)
                return
            nxt = opt._work_item(item)
            del opt

    def _work_item(self, item: tuple[int, int]) -> Any:
        """Step one chunk (worker thread); return the next queue item if it took one early."""
        nxt = None
        t0 = time.perf_counter()
        lane = item in self._lane_chunks  # done when its write-back is (see _reap_lane)
        try:
            if lane:
                self._step_chunk_gpu(*item)
            else:
                copies = self._copy_grads(*item)
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    pass
                if nxt is not None and nxt is not _STOP and nxt not in self._lane_chunks:
                    try:
                        self._copy_grads(*nxt)  # its D2H runs while this chunk steps
                    except BaseException:
                        pass  # raised again, and reported, when that chunk is stepped
                self._step_chunk(*item, copies)
        except BaseException as exc:  # surfaced by step()
            lane = False  # nothing of it is pending: it is done (and failed) now
            with self._lock:
                self._errors.append(exc)
        finally:
            with self._stats_lock:
                self._acc["worker_s"] += time.perf_counter() - t0
            if not lane:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()
        self._reap_lane(block=False)
        return nxt

    def _chunk_grads(self, g: int, c: int) -> tuple[dict[int, tuple | None], list]:
        """Chunk ``c``'s gradients once they may be read: ``({local tensor: (flat gradient,
        event) or None}, the events a copy or step of them must wait for)`` -- the clip's, with
        clipping, else each gradient's own. Blocks until ``step()`` has clipped (clipping)."""
        self._compute_allowed.wait()  # with clipping: step() has clipped the GPU gradients
        with self._lock:
            refs = {pc.param: self._grad_refs.get((g, pc.param))
                    for pc in self._groups[g].plan.chunks[c].pieces}
        if self._clip_event is not None:
            return refs, [self._clip_event]  # the clipped gradients are complete here
        return refs, list(dict.fromkeys(ref[1] for ref in refs.values()
                                        if ref is not None and ref[1] is not None))

    def _step_hp(self, g: int) -> dict:
        """Group ``g``'s hyper-parameters for the chunks being stepped: as of ``step()``."""
        return self._frozen_hp[g] if self._frozen_hp is not None else self.param_groups[g]

    def _copy_grads(self, g: int, c: int) -> tuple[torch.Tensor, dict[int, bool], Any]:
        """Issue the D2H copy of chunk ``c``'s gradients into the group's next gradient slot
        (once per chunk and step; worker thread only).

        Returns ``(host gradient of the chunk, {local tensor: has a gradient}, the last copy's
        event or None)``.
        """
        done = self._copies.get((g, c))
        if done is not None:
            return done
        group = self._groups[g]
        chunk: Chunk = group.plan.chunks[c]
        refs, waits = self._chunk_grads(g, c)
        slot = group.grad_next
        group.grad_next = (slot + 1) % _GRAD_SLOTS  # the slot's last chunk has been stepped
        buf = group.grad_ring[slot][:chunk.numel]
        pairs, nbytes = [], 0
        for pc in chunk.pieces:
            if refs[pc.param] is None:
                continue
            rel = pc.flat_offset - chunk.flat_start
            grad = refs[pc.param][0][pc.start:pc.start + pc.numel]
            pairs.append((buf[rel:rel + pc.numel], grad))
            nbytes += pc.numel * buf.element_size()
        last = self._copier.d2h_many(pairs, after=waits or None) if pairs else None
        with self._stats_lock:
            self._acc["d2h_bytes"] += nbytes
        done = (buf, {p: ref is not None for p, ref in refs.items()}, last)
        self._copies[(g, c)] = done
        return done

    def _step_chunk(self, g: int, c: int, copies: tuple) -> None:
        group = self._groups[g]
        chunk: Chunk = group.plan.chunks[c]
        grad, has_grad, copied = copies
        t_wait = time.perf_counter()
        if copied is not None:
            copied.synchronize()  # the CPU reads the gradient bytes of this chunk's D2H
        wait_s = time.perf_counter() - t_wait
        key = group.chunk_keys[c]
        blob = self._store.get(key, "cpu", hold=True)
        try:
            master, exp_avg, exp_avg_sq = _state_views(blob, chunk.numel, self.moments_dtype)
            self._prefetch_after(g, c)
            lo = chunk.flat_start
            t_wait = time.perf_counter()
            out, slot = self._out_slot(group, chunk.numel)
            wait_s += time.perf_counter() - t_wait
            hp = self._step_hp(g)
            beta1, beta2 = hp["betas"]
            runs = self._runs(group, chunk, has_grad)
            t0 = time.perf_counter()
            for start, numel, step in runs:
                adam_step_unchecked(master, grad, exp_avg, exp_avg_sq, step=step,
                                    lr=float(hp["lr"]), beta1=beta1, beta2=beta2, eps=hp["eps"],
                                    weight_decay=hp["weight_decay"], adamw=hp["adamw"],
                                    maximize=hp["maximize"], param_out=out, offset=start,
                                    numel=numel, num_threads=self.cpu_threads)
            adam_s = time.perf_counter() - t0
            pairs, h2d = [], 0
            for pc in chunk.pieces:
                if not has_grad[pc.param]:
                    continue  # no gradient this step: param and state untouched, like torch
                rel = pc.flat_offset - lo
                pairs.append((self._local(group, pc.param)[pc.start:pc.start + pc.numel],
                              out[rel:rel + pc.numel]))
                h2d += pc.numel * out.element_size()
            last = self._copier.h2d_many(pairs)
            with self._stats_lock:
                self._acc["cpu_adam_s"] += adam_s
                self._acc["copy_wait_s"] += wait_s
                self._acc["h2d_bytes"] += h2d
                self._acc["chunks"] += 1
            group.out_events[slot] = last
        finally:
            self._store.release(key)
        if (g, c) in self._nvme_chunks:
            self._store.evict(key, "nvme")  # write-back overlaps the next chunk's compute
        with self._idle:
            if last is not None:
                self._h2d_events.append(last)
            self._chunk_h2d[(g, c)] = last
            self._idle.notify_all()  # a forward may wait for this chunk (Note [forward sync])

    @staticmethod
    def _out_slot(group: _Group, numel: int) -> tuple[torch.Tensor, int]:
        """The next param-out ring slot (``numel`` elements) and its index; worker thread only."""
        slot = group.out_next
        group.out_next = (slot + 1) % _OUT_SLOTS
        if group.out_events[slot] is not None:
            group.out_events[slot].synchronize()  # the slot's last H2D must finish before reuse
        return group.out_ring[slot][:numel], slot

    def _runs(self, group: _Group, chunk: Chunk, has_grad: dict) -> list[tuple[int, int, int]]:
        """(start in chunk, numel, step) runs of consecutive pieces that have gradients."""
        runs: list[list[int]] = []
        for pc in chunk.pieces:
            if not has_grad[pc.param]:
                continue
            step = group.steps[pc.param] + 1
            start = pc.flat_offset - chunk.flat_start
            if runs and runs[-1][2] == step and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += pc.numel
            else:
                runs.append([start, pc.numel, step])
        return [tuple(r) for r in runs]

    def _prefetch_after(self, g: int, c: int) -> None:
        if not self._nvme_chunks:
            return
        if self._order_pos is None:  # the plan and the tiers are fixed: index the order once
            order = self._expected_order()
            self._order_pos = (order, {item: k for k, item in enumerate(order)})
        order, pos = self._order_pos
        with self._lock:  # chunks whose gradients came early were stepped already
            self._read_ahead.discard((g, c))
            room = self.nvme_lookahead_chunks - len(self._read_ahead)  # bounded: never evicted
            later = list(itertools.islice(
                (item for item in itertools.islice(order, pos[(g, c)] + 1, None)
                 if item in self._nvme_chunks and item not in self._queued
                 and item not in self._read_ahead), max(0, room)))
            self._read_ahead.update(later)
        for gg, cc in later:
            self._store.prefetch(self._groups[gg].chunk_keys[cc], "cpu")

    # ------------------------------------------------------------------ the GPU lane

    def _init_lane(self) -> None:
        """Pick the lane's chunks (``gpu_step_fraction`` of the offloaded chunks, spread evenly
        over the order they are stepped in) and allocate its device slots."""
        self._lane_chunks = set()
        if self.gpu_step_fraction == 0.0:
            return
        order = self._expected_order()
        share = self.gpu_step_fraction
        self._lane_chunks = {item for k, item in enumerate(order)
                             if int((k + 1) * share) > int(k * share)}
        if not self._lane_chunks:
            return
        chunks = [self._groups[g].plan.chunks[c] for g, c in self._lane_chunks]
        numel = max(c.numel for c in chunks)
        self._lane_state = [torch.empty(_state_numel(numel, self.moments_dtype),
                                        dtype=torch.float32, device=self.device)
                            for _ in range(_LANE_SLOTS)]
        self._lane_grad = [torch.empty(numel, dtype=torch.float32, device=self.device)
                           for _ in range(_LANE_SLOTS)]
        self._lane_free = [None] * _LANE_SLOTS
        # own copy streams: a lane copy waits for lane work, which must never hold up the CPU
        # chunks' gradient and param copies queued behind it on shared streams
        self._lane_copier = Copier(self.device)
        if self._copier.cuda:
            self._lane_stream = torch.cuda.Stream(self.device)

    def _step_chunk_gpu(self, g: int, c: int) -> None:
        """Note [gpu lane]: step chunk ``c`` on the GPU: its state H2D into a device slot, the
        fused Adam on the lane stream with the gradients where backward left them, the updated
        params cast into the model, the state D2H back into its blob. Issues and returns; the
        blob stays held until ``_reap_lane`` sees the write-back done."""
        group = self._groups[g]
        chunk: Chunk = group.plan.chunks[c]
        refs, waits = self._chunk_grads(g, c)
        has_grad = {p: ref is not None for p, ref in refs.items()}
        key = group.chunk_keys[c]
        blob = self._store.get(key, "cpu", hold=True)
        loaded = None
        try:
            self._prefetch_after(g, c)
            slot = self._lane_next
            self._lane_next = (slot + 1) % _LANE_SLOTS
            state = self._lane_state[slot][:_state_numel(chunk.numel, self.moments_dtype)]
            grads = self._lane_grad[slot]
            loaded = self._lane_copier.h2d_many([(state, blob)], after=self._lane_free[slot])
            cuda = self._lane_stream is not None
            with torch.cuda.stream(self._lane_stream) if cuda else _nullcontext():
                if cuda:
                    self._lane_stream.wait_event(loaded)  # the state is on the device
                    for ev in waits:
                        self._lane_stream.wait_event(ev)  # the gradients are complete
                master, exp_avg, exp_avg_sq = _state_views(state, chunk.numel, self.moments_dtype)
                lo = chunk.flat_start
                for pc in chunk.pieces:
                    if has_grad[pc.param]:
                        rel = pc.flat_offset - lo
                        src = refs[pc.param][0][pc.start:pc.start + pc.numel]
                        grads[rel:rel + pc.numel].copy_(src)  # widened to fp32
                hp = self._step_hp(g)
                runs = self._runs(group, chunk, has_grad)
                if runs:
                    self._fused_runs(master, grads, exp_avg, exp_avg_sq, runs, hp)
                for pc in chunk.pieces:
                    if has_grad[pc.param]:
                        rel = pc.flat_offset - lo
                        self._local(group, pc.param)[pc.start:pc.start + pc.numel].copy_(
                            master[rel:rel + pc.numel])
                stepped = None
                if cuda:
                    stepped = torch.cuda.Event()
                    stepped.record(self._lane_stream)  # params updated; the state may go back
            written = self._lane_copier.d2h_many([(blob, state)], after=stepped)
        except BaseException:  # error path: let what was issued finish before the blob goes
            if loaded is not None:
                loaded.synchronize()  # the state load has read the blob
            if self._lane_stream is not None:
                self._lane_stream.synchronize()  # nothing queued still uses the slot
            self._store.release(key)
            raise
        self._lane_free[slot] = written
        with self._stats_lock:  # the lane's PCIe traffic is the state, both ways
            self._acc["h2d_bytes"] += state.numel() * 4
            self._acc["d2h_bytes"] += state.numel() * 4
            self._acc["chunks"] += 1
            self._acc["gpu_chunks"] += 1
        with self._idle:
            if stepped is not None:
                self._h2d_events.append(stepped)
            self._chunk_h2d[(g, c)] = stepped
            self._lane_pending.append((written, g, c))
            self._idle.notify_all()  # a forward may wait for this chunk (Note [forward sync])

    def _fused_runs(self, master: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, runs: list[tuple[int, int, int]], hp: dict) -> None:
        """torch's fused Adam on the ``(start, numel, step)`` runs of a chunk in place (on the
        current stream); bf16 moments are widened to fp32 and rounded back, as the CPU kernel."""
        sl = [slice(start, start + numel) for start, numel, _ in runs]
        ms = [exp_avg[k] for k in sl]
        vs = [exp_avg_sq[k] for k in sl]
        wide = self.moments_dtype != torch.float32
        m32 = [m.float() for m in ms] if wide else ms
        v32 = [v.float() for v in vs] if wide else vs
        steps = [torch.full((), float(step), dtype=torch.float32, device=master.device)
                 for _, _, step in runs]
        _fused_adam_([master[k] for k in sl], [grads[k] for k in sl], m32, v32, steps, hp)
        if wide:
            for m, v, a, b in zip(ms, vs, m32, v32):
                m.copy_(a)
                v.copy_(b)

    def _reap_lane(self, block: bool) -> None:
        """Release the blobs of lane chunks whose state is back in the store (with ``block``,
        after waiting for the oldest); each counts as done for ``step()`` only then. Worker
        thread only."""
        while self._lane_pending:
            written, g, c = self._lane_pending[0]
            if written is not None and not block and not written.query():
                return
            block = False
            self._lane_pending.popleft()
            try:
                if written is not None:
                    written.synchronize()  # the host blob holds the updated state after this
                key = self._groups[g].chunk_keys[c]
                self._store.release(key)
                if (g, c) in self._nvme_chunks:
                    self._store.evict(key, "nvme")  # write-back overlaps the next chunks
            except BaseException as exc:  # surfaced by step()
                with self._lock:
                    self._errors.append(exc)
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimizer step (see the module docstring for what overlaps).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        With ``data_parallel`` or FSDP2 params this is collective: every rank calls it.

        Raises:
            RuntimeError: the CPU step failed (the worker's error is chained; the message
                names the rank under torch.distributed), too many backward passes, or a child
                forked from the process that made the optimizer.
            TierFullError: the first step could not allocate the state (no room in the store);
                nothing is left half-allocated, so a later step retries once there is room.
        """
        self._check_process()
        if self._pending:
            self._finish_step()  # two steps without a forward between them
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_step = time.perf_counter()
        try:
            self._ensure_state()  # Note [trace placement]: the first step plans and allocates
        except BaseException:
            self._begin_step()  # undone: the next backward and step start afresh
            raise
        # chunks stepped from now on use this step's hyper-parameters, even when an LR
        # scheduler changes them before the worker is done (param_sync="forward")
        self._frozen_hp = [{k: v for k, v in hp.items() if k != "params"}
                           for hp in self.param_groups]
        with self._lock:
            extra = [k for k, n in self._acc_count.items() if n > self.grad_accumulation_steps]
        if extra:
            raise RuntimeError(
                f"{self._who}: {self._acc_count[extra[0]]} backward passes accumulated into a "
                f"parameter before step(), but grad_accumulation_steps="
                f"{self.grad_accumulation_steps}: gradients were copied off the GPU after pass "
                f"{self.grad_accumulation_steps}; set grad_accumulation_steps to the number of "
                f"backward passes per step")
        self._check_grads_untouched()
        if self._mode == "fsdp":
            self._refresh_views()
        if self._zero is not None:  # buckets not reduced in backward, then the has-grad flags
            self._ship_buckets(self._zero.flush(lambda g, i: self._groups[g].params[i].grad))
        with self._zero.on_stream() if self._zero is not None else _nullcontext():
            for g in self._groups:
                for i in g.plan.chunks_of_param:
                    if (g.index, i) not in self._shipped:
                        self._ship(g.index, i)  # not shipped by a hook (no overlap / no grad / early step)
        if self._zero is not None:
            self._zero.join_stream()  # the GPU side and clipping read the reduced gradients
        if self.max_grad_norm is not None:
            self._clip(self.max_grad_norm)  # no gradient has been copied yet (_copy_grads waits)
            if self._copier.cuda:
                self._clip_event = torch.cuda.Event()
                self._clip_event.record(self._copier.consumer_stream())  # D2H copies clipped grads
        self._compute_allowed.set()
        for g in self._groups:
            self._step_gpu_side(g)
        self._t_step = t_step
        self._stepped = [(g, i) for g in self._groups for i in range(g.n_local)  # before zero_grad
                         if self._has_grad(g, i)]
        if self.param_sync == "forward":
            self._pending = True  # the next forward waits per module (Note [forward sync])
            return loss
        self._finish_step()
        return loss

    def _check_process(self) -> None:
        """Refuse work in a forked child (Note [lifetime]).

        Raises:
            RuntimeError: this process is not the one that made the optimizer.
        """
        if os.getpid() != self._pid:
            raise RuntimeError(f"{self._who} was made by process {self._pid}; this is a child "
                               f"forked from it (pid {os.getpid()}), which has none of its "
                               f"worker threads: make a new optimizer in the child")

    def synchronize(self) -> None:
        """Complete the last ``step()`` (with ``param_sync="forward"`` it may still be updating
        offloaded params): afterwards every param holds its update for the caller's stream.

        Raises:
            RuntimeError: the CPU step failed.
        """
        if self._pending:
            self._finish_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, like ``torch.optim.Optimizer.zero_grad``.

        ``set_to_none=False`` zeroes the gradient tensors in place, which the CPU side of a
        ``param_sync="forward"`` step may not have copied yet: that step is completed first
        (``set_to_none=True`` drops the references instead, and the CPU side keeps its own).
        The same holds for ``model.zero_grad(set_to_none=False)``: call ``synchronize()``
        before it.

        Raises:
            RuntimeError: the CPU step being completed failed.
        """
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook (param_sync="forward"): wait for this module's params."""
        if not self._pending:
            return
        # a compiled module runs its submodules inside one graph, without their hooks: wait
        # here for every parameter under it (the whole model for torch.compile(model))
        compiled = isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or getattr(
            module, "_compiled_call_impl", None) is not None
        params = module.parameters() if compiled else module._parameters.values()
        chunks = [item for p in params if p is not None
                  for item in self._chunks_of.get(id(p), ())]
        if not chunks:
            return
        with self._idle:
            while any(item not in self._chunk_h2d for item in chunks) and not self._errors:
                self._idle.wait()  # the worker has not stepped this module's chunks yet
            events = [self._chunk_h2d.get(item) for item in chunks]
            done = len(self._chunk_h2d) == len(self._chunk_missing) or bool(self._errors)
        if done:
            self._finish_step()
            return
        consumer = self._copier.consumer_stream()
        for event in events if consumer is not None else ():
            if event is not None:
                consumer.wait_event(event)  # this module reads the params copied H2D

    def _finish_step(self) -> None:
        """Wait for the CPU side of the last ``step()``, make the caller's stream wait for its
        H2D copies, count the step and start the next one."""
        self._pending = False
        t_step = self._t_step
        t_wait = time.perf_counter()
        with self._idle:
            while self._outstanding:
                self._idle.wait()  # the CPU step of every offloaded chunk has to finish
            errors, self._errors = self._errors, []
            events = self._h2d_events
        stall = time.perf_counter() - t_wait
        if self._zero is not None and self._zero.any_failed(bool(errors)) and not errors:
            self._begin_step()  # the optimizer takes the next step; this one is lost
            raise RuntimeError(f"{self._who}: another rank's CPU step failed (its error names "
                               f"it); this step was abandoned on every rank")
        if errors:
            self._begin_step()
            raise RuntimeError(f"{self._who}: the CPU step failed: {errors[0]} (some offloaded "
                               f"chunks may have been updated: resume from a checkpoint to stay "
                               f"exact)") from errors[0]
        consumer = self._copier.consumer_stream()
        for event in events if consumer is not None else ():
            consumer.wait_event(event)  # the next forward reads the parameters copied H2D
        if self._zero is not None:  # every rank gets every rank's updated shard
            self._zero.gather(lambda g: ([self._local(self._groups[g], i)
                                          for i in range(self._groups[g].n_local)],
                                         self._groups[g].params))
        for g, i in self._stepped:
            g.steps[i] += 1  # after the worker: it steps chunks with steps[i] + 1
        moved = self._store.stats()["moved_bytes"]
        with self._stats_lock:
            done = dict(self._acc, stall_s=stall, step_s=time.perf_counter() - t_step)
            done["nvme_read_bytes"] = moved.get("nvme->cpu", 0) - self._moved0.get("nvme->cpu", 0)
            done["nvme_write_bytes"] = moved.get("cpu->nvme", 0) - self._moved0.get("cpu->nvme", 0)
            self._last_stats = done
        self._begin_step()

    def _check_grads_untouched(self) -> None:
        """Refuse a step whose gradients changed after backward copied them off the GPU.

        With overlap, an offloaded gradient is copied D2H (and may already be stepped on the
        CPU) the moment it is accumulated; ``torch.nn.utils.clip_grad_norm_`` or a GradScaler's
        ``unscale_`` after backward would then change only the copy left on the GPU and the
        step would silently mix clipped and unclipped gradients. The grads' version counters
        tell.

        Raises:
            RuntimeError: a gradient was modified in place or replaced after it was shipped.
        """
        with self._lock:
            shipped = dict(self._shipped_versions)
        for (g, i), (version, ptr) in shipped.items():
            grad = self._groups[g].params[i].grad
            if grad is None or grad._version != version or grad.data_ptr() != ptr:
                raise RuntimeError(
                    f"{self._who}: a gradient was changed after backward had already copied it "
                    f"off the GPU (overlap=True), e.g. by torch.nn.utils.clip_grad_norm_ or "
                    f"GradScaler.unscale_; clip with HybridAdam(max_grad_norm=...), which clips "
                    f"every gradient on and off the GPU, or build HybridAdam with overlap=False "
                    f"so gradients are copied in step(). This step was not applied consistently: "
                    f"restart from a checkpoint")

    def _step_gpu_side(self, g: _Group) -> None:
        hp = self.param_groups[g.index]
        idx = [k for k, pc in enumerate(g.plan.gpu_pieces) if self._has_grad(g, pc.param)]
        if not idx:
            return
        grads = []
        for k in idx:
            pc = g.plan.gpu_pieces[k]
            grad = self._grad_of(g, pc.param).detach()[pc.start:pc.start + pc.numel]
            grads.append(grad if grad.dtype == torch.float32 else grad.float())
        masters = [g.gpu_masters[k] for k in idx]
        steps = [g.gpu_steps[k] for k in idx]
        torch._foreach_add_(steps, 1)
        _fused_adam_(masters, grads, [g.gpu_exp_avg[k] for k in idx],
                     [g.gpu_exp_avg_sq[k] for k in idx], steps, hp)
        for k in idx:
            if g.gpu_views[k] is not g.gpu_masters[k]:
                g.gpu_views[k].copy_(g.gpu_masters[k])

    def _clip(self, max_norm: float) -> None:
        """Clip all grads in place to ``max_norm`` like ``torch.nn.utils.clip_grad_norm_`` (on
        the caller's stream, no host synchronisation).

        Distributed: the squared norm of this rank's (shard) gradients is all-reduced over the
        data-parallel group, or over the mesh dimensions FSDP2 shards on, so every rank clips
        by the norm of the whole averaged gradient."""
        if self._mode == "local":
            params = [p for g in self._groups for p in g.params if p.grad is not None]
            grads = [p.grad for p in params]
            total = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
                else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        else:
            grads = [self._grad_of(g, i) for g in self._groups for i in range(g.n_local)
                     if self._has_grad(g, i)]
            grads = [t for t in grads if t.numel()]
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            if grads:
                norms = torch._foreach_norm(grads, 2.0)
                sq = torch.stack([n.float() for n in norms]).square().sum()
            for group in self._norm_groups:
                torch.distributed.all_reduce(sq, group=group)
            total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Not supported after backward with overlap: pass ``max_grad_norm`` instead.

        Raises:
            RuntimeError: always explains how to clip with HybridAdam.
        """
        raise RuntimeError("HybridAdam: gradients are copied off the GPU during backward, so "
                           "clip with HybridAdam(max_grad_norm=...) which clips every gradient, "
                           "on and off the GPU, inside step()")

    # ------------------------------------------------------------------ state dict

    def _drain(self) -> None:
        with self._idle:
            while self._outstanding:
                self._idle.wait()  # state must not change while it is read or written

    def _param_states(self) -> list[list[dict]]:
        """Per-param state in torch's format: step, exp_avg, exp_avg_sq (+ master).

        One process: full-size CPU tensors. FSDP2: DTensors like the params (local shard on
        the CPU). Data parallel: full-size CPU tensors on every rank (collective)."""
        local = self._local_states()
        if self._mode == "zero":
            return self._gather_states(local)
        out = []
        for g, states in zip(self._groups, local):
            group_out = []
            for i, st in enumerate(states):
                p = g.params[i]
                shape = _dist.local_of(p).shape
                full = {"step": torch.tensor(float(st["step"]))}
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in st:
                        t = st[name].view(shape)
                        full[name] = _dist.to_dtensor(t, p) if self._mode == "fsdp" else t
                group_out.append(full)
            out.append(group_out)
        return out

    def _gather_states(self, local: list[list[dict]]) -> list[list[dict]]:
        """Data parallel: assemble every param's full state from the ranks' shards (an
        all-reduce of disjoint pieces, staged through bounded buffers on the params' device)."""
        zero = self._zero
        out = []
        for g, states in zip(self._groups, local):
            zg = zero.groups[g.index]
            names = ["exp_avg", "exp_avg_sq"]
            if g.params and g.params[0].dtype != torch.float32:
                names.append("master")
            full = {name: torch.zeros(zg.total, dtype=torch.float32) for name in names}
            for seg, st in zip(zg.segments, states):
                for name in names:
                    full[name][seg.flat_offset:seg.flat_offset + seg.numel] = st[name]
            stage = 1 << 24
            for name in names:
                for lo in range(0, zg.total, stage):
                    piece = full[name][lo:lo + stage].to(self.device)
                    torch.distributed.all_reduce(piece, group=zero.pg)
                    full[name][lo:lo + stage] = piece.cpu()
            steps = torch.zeros(len(g.params), dtype=torch.int64)
            for seg, st in zip(zg.segments, states):
                steps[seg.param] = max(int(steps[seg.param]), st["step"])
            steps = steps.to(self.device)
            torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MAX, group=zero.pg)
            steps = steps.cpu()
            group_out = []
            for i, p in enumerate(g.params):
                sl = slice(zg.offsets[i], zg.offsets[i + 1])
                st = {"step": torch.tensor(float(steps[i]))}
                for name in names:
                    st[name] = full[name][sl].view(p.shape)
                group_out.append(st)
            out.append(group_out)
        return out

    def _local_states(self) -> list[list[dict]]:
        """Per local tensor: flat CPU ``exp_avg``, ``exp_avg_sq`` (+ ``master`` for non-fp32
        params) and the int ``step``, gathered from GPU, RAM and NVMe."""
        out = []
        for g in self._groups:
            states = []
            for i in range(g.n_local):
                local = self._local(g, i)
                st = {"step": g.steps[i],
                      "exp_avg": torch.zeros(local.numel(), dtype=torch.float32),
                      "exp_avg_sq": torch.zeros(local.numel(), dtype=torch.float32)}
                if local.dtype != torch.float32:
                    st["master"] = local.float().cpu()
                states.append(st)
            for k, pc in enumerate(g.plan.gpu_pieces):
                st = states[pc.param]
                sl = slice(pc.start, pc.start + pc.numel)
                st["exp_avg"].view(-1)[sl] = g.gpu_exp_avg[k].cpu()
                st["exp_avg_sq"].view(-1)[sl] = g.gpu_exp_avg_sq[k].cpu()
                if "master" in st:
                    st["master"].view(-1)[sl] = g.gpu_masters[k].cpu()
            for pc, sl, (master, exp_avg, exp_avg_sq) in self._offloaded_pieces(g):
                st = states[pc.param]
                st["exp_avg"].view(-1)[sl] = exp_avg
                st["exp_avg_sq"].view(-1)[sl] = exp_avg_sq
                if "master" in st:
                    st["master"].view(-1)[sl] = master
            out.append(states)
        return out

    def _offloaded_pieces(self, g: _Group):
        """Yield ``(piece, slice of the local tensor, (master, exp_avg, exp_avg_sq) views of the
        piece's state)`` for every offloaded piece of ``g``, chunk by chunk; a chunk's state is
        held in RAM while its pieces are visited and written back to NVMe after."""
        for chunk, key in zip(g.plan.chunks, g.chunk_keys):
            blob = self._store.get(key, "cpu", hold=True)
            try:
                views = _state_views(blob, chunk.numel, self.moments_dtype)
                for pc in chunk.pieces:
                    rel = pc.flat_offset - chunk.flat_start
                    yield (pc, slice(pc.start, pc.start + pc.numel),
                           tuple(v[rel:rel + pc.numel] for v in views))
            finally:
                self._store.release(key)
            if (g.index, chunk.index) in self._nvme_chunks:
                self._store.evict(key, "nvme").wait()

    def state_dict(self) -> dict:
        """Return the state in torch.optim's format (``exp_avg``/``exp_avg_sq``/``step`` per
        param, plus ``master`` for non-fp32 params), gathered from GPU, RAM and NVMe.

        One process: full CPU tensors. FSDP2: DTensors with the params' mesh and placements
        (local shard on the CPU), for ``torch.distributed.checkpoint`` (each rank saves its
        shard; loading reshards, onto another world size too). ``data_parallel``: full CPU
        tensors on every rank (collective; ``torch.save`` it on rank 0, or use DCP), loadable
        on any world size and by a single-process optimizer.

        Raises:
            RuntimeError: called in a child forked from the process that made the optimizer.
            TierFullError: the state could not be allocated yet (first use) and the store has
                no room; nothing is left half-allocated, so it can be retried.
        """
        self._check_process()
        self.synchronize()
        self._ensure_state()
        self._drain()
        states = self._param_states()
        flat_state, index, groups = {}, 0, []
        for g, hp in zip(states, self.param_groups):
            ids = list(range(index, index + len(g)))
            for i, st in zip(ids, g):
                flat_state[i] = st
            groups.append({**{k: v for k, v in hp.items() if k != "params"}, "params": ids})
            index += len(g)
        return {"state": flat_state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` (or torch.optim.Adam/AdamW's ``state_dict``).

        Any world size: full tensors are cut to this rank's shard (data parallel, FSDP2);
        DTensors (FSDP2, e.g. loaded by ``torch.distributed.checkpoint``) are redistributed to
        the params' placements.

        Raises:
            ValueError: the number of groups or params, or a tensor's shape, does not match.
            RuntimeError: called in a child forked from the process that made the optimizer.
        """
        self._check_process()
        self.synchronize()
        self._ensure_state()
        self._drain()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{self._who}.load_state_dict: the state has {len(groups)} param "
                             f"groups but this optimizer has {len(self.param_groups)}")
        for gi, (saved, g) in enumerate(zip(groups, self._groups)):
            if len(saved["params"]) != len(g.params):
                raise ValueError(f"{self._who}.load_state_dict: param group {gi} has "
                                 f"{len(saved['params'])} params in the state but "
                                 f"{len(g.params)} here")
            for sid, p in zip(saved["params"], g.params):
                st = state_dict["state"].get(sid)
                if st is None:
                    continue
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in st and tuple(st[name].shape) != tuple(p.shape):
                        raise ValueError(f"{self._who}.load_state_dict: {name} of param {sid} "
                                         f"has shape {tuple(st[name].shape)} but the param has "
                                         f"{tuple(p.shape)}; the state is for another model")
        for saved, hp in zip(groups, self.param_groups):
            hp.update({k: v for k, v in saved.items() if k != "params"})
        for saved, g in zip(groups, self._groups):
            sts = [state_dict["state"].get(sid) for sid in saved["params"]]
            self._scatter(g, sts)

    def _scatter(self, g: _Group, param_sts: list[dict | None]) -> None:
        self._check_grads_untouched()
        if self._mode == "fsdp":
            self._refresh_views()
        sts = [param_sts[self._param_of(g, i)] for i in range(g.n_local)]

        def local_src(i: int, name: str) -> torch.Tensor:
            """This rank's part of saved tensor ``name`` of local tensor ``i``, flat."""
            t = sts[i][name]
            p = g.params[self._param_of(g, i)]
            if self._mode == "fsdp":
                return _dist.local_state(t, p, name, self._who).reshape(-1)
            if g.segments is not None:
                seg = g.segments[i]
                return t.reshape(-1)[seg.start:seg.start + seg.numel]
            return t.reshape(-1)

        def master_of(i):
            st = sts[i]
            if st is not None and "master" in st:
                return local_src(i, "master").float()
            return self._local(g, i).float().cpu()

        for i, st in enumerate(sts):
            g.steps[i] = int(float(st["step"])) if st is not None else 0
        for k, pc in enumerate(g.plan.gpu_pieces):
            st = sts[pc.param]
            sl = slice(pc.start, pc.start + pc.numel)
            zero = torch.zeros(pc.numel)
            g.gpu_exp_avg[k].copy_(local_src(pc.param, "exp_avg")[sl] if st else zero)
            g.gpu_exp_avg_sq[k].copy_(local_src(pc.param, "exp_avg_sq")[sl] if st else zero)
            g.gpu_steps[k].fill_(float(g.steps[pc.param]))
            if g.gpu_masters[k] is not g.gpu_views[k]:
                g.gpu_masters[k].copy_(master_of(pc.param)[sl])
        for pc, sl, (master, exp_avg, exp_avg_sq) in self._offloaded_pieces(g):
            master.copy_(master_of(pc.param)[sl])
            for moment, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
                if sts[pc.param]:
                    moment.copy_(local_src(pc.param, name)[sl])
                else:
                    moment.zero_()

    # ------------------------------------------------------------------ misc

    def add_param_group(self, param_group: dict) -> None:
        """Only during construction: the partition is fixed once built.

        Raises:
            RuntimeError: when called after construction.
        """
        if hasattr(self, "_groups"):
            raise RuntimeError("HybridAdam: param groups are fixed at construction; create a new "
                               "HybridAdam with all groups")
        super().add_param_group(param_group)

    def state_numel(self) -> dict[str, int]:
        """Parameter elements whose optimizer state this rank holds: ``{"gpu": n, "offloaded": n}``
        (elements, not bytes; with ``data_parallel`` or FSDP2 about ``1/world`` of the model)."""
        return {"gpu": sum(g.plan.gpu_numel for g in self._groups),
                "offloaded": sum(g.plan.cpu_numel for g in self._groups)}

    def memory_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes per place: ``{"gpu": ..., "cpu": ..., "nvme": ...}``."""
        self._ensure_state()
        gpu = sum(t.numel() * 4 for g in self._groups
                  for t in g.gpu_exp_avg + g.gpu_exp_avg_sq) + sum(
            m.numel() * 4 for g in self._groups for m, v in zip(g.gpu_masters, g.gpu_views)
            if m is not v) + sum(t.numel() * t.element_size()
                                  for t in self._lane_state + self._lane_grad)
        s = self._store.stats()
        return {"gpu": gpu, "cpu": s["cpu"]["used_bytes"], "nvme": s["nvme"]["used_bytes"]}

    def close(self) -> None:
        """Complete a pending step, stop the worker, remove the hooks, release the split tier's
        RAM chunks and close the private store. Idempotent.

        Dropping the optimizer without ``close()`` does the same, except completing a pending
        step (Note [lifetime]).
        """
        if getattr(self, "_pending", False) and os.getpid() == self._pid:
            try:
                self._finish_step()
            except RuntimeError:
                pass  # closing anyway; the failed step was reported by the hook or step()
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()


def _grad_hook(ref: weakref.ref, method: str, g: int, i: int, param: torch.Tensor) -> None:
    """A post-accumulate-grad hook's body: ``method(g, i)`` of the optimizer if it still exists
    (Note [lifetime])."""
    opt = ref()
    if opt is not None:
        getattr(opt, method)(g, i)


def _call_weak_forward(ref: weakref.ref, module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook (param_sync="forward") through a weak reference."""
    opt = ref()
    if opt is not None:
        opt._before_forward(module, args)


def _release(work: queue.Queue, worker: threading.Thread, hooks: list, ram_held: list,
             store: TierStore, owns_store: bool, pid: int) -> None:
    """Finalizer of a HybridAdam (and the end of ``close()``): stop the worker, remove the
    hooks, release held RAM chunks, close a private store. Runs once; holds no reference to
    the optimizer (Note [lifetime]). In a forked child (no worker there, its queue's lock may
    have been copied held) it only lets a private store forget the child's copy."""
    if os.getpid() != pid:
        if owns_store:
            store.close()  # Note [fork] of the store: the parent's files stay
        return
    work.put(_STOP)
    if worker is not threading.current_thread():  # the worker may drop the last reference
        worker.join()
    for handle in hooks:
        handle.remove()
    hooks.clear()
    for key in ram_held:
        try:
            store.release(key)
        except Exception:  # noqa: BLE001  (the store was closed or the key deleted by its owner)
            pass
    ram_held.clear()
    if owns_store:
        store.close()
