"""HybridAdam: Adam/AdamW whose state is split between the GPU and pinned host RAM or NVMe.

A ``torch.optim.Optimizer``: LR schedulers, ``zero_grad``, param groups and ``state_dict`` work
as usual. Per param group, the first ``1 - offload_fraction`` of the bytes (execution order: the
first layers) keep fp32 masters and the moments (in ``moments_dtype``) on the GPU and step there
with torch's fused Adam; the rest (the offloaded side) keeps them in the TierStore's ``"cpu"``
tier (pinned) or streams them through its ``"nvme"`` tier, and steps on the CPU with tiermem's
native kernel. bf16 moments are stored in bf16 on both sides (and stream through the GPU
lane so); every step widens them to fp32, updates, and rounds them back to nearest even.

How one step overlaps (``overlap=True``), see Note [hybrid step]:
1. backward: a post-accumulate-grad hook hands each offloaded gradient to the CPU side as soon
   as it is accumulated (last micro-batch only), with an event marking it complete (with
   ``max_grad_norm`` in one process ``step()`` hands them over instead: Note [stepping order]);
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
``step()`` has clipped them all on the GPU (the copies then wait for the clip; in one process
they are also handed over only then, in forward order: Note [stepping order]).

Note [stepping order]: the offloaded chunks are stepped in the order their gradients complete
(backward order: the last layers first) when that lets the CPU step overlap backward. With
``max_grad_norm`` in one process nothing can be stepped before ``step()`` has the global norm,
so the hooks only count, ``step()`` ships every gradient in execution order and the worker steps
the chunks in forward order: the first layers' chunks first, which is the order the next
forward needs them in with ``param_sync="forward"`` (Note [forward sync]; the first layers'
state is on the GPU side, stepped at once). The NVMe read-ahead, the split tier's RAM choice and
the GPU lane's share follow the same order (``StateLayout.expected_order``). With data parallel
or FSDP2 the reduce buckets and FSDP's hooks keep backward order.

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
waits for work through a weak reference to its chunk worker (which it holds only while it steps
a chunk, and which holds no reference to the optimizer), and the gradient and forward hooks call
it through weak references, so dropping the last
reference collects it even while the model lives on. Its ``weakref.finalize`` (also run by
``close()`` and at interpreter exit) stops the worker, removes the hooks, releases held RAM
chunks and closes a private store, which removes its spill directory and I/O threads; on a
caller's store it releases and deletes every key the optimizer made (``free_owner_keys``: its
state goes with it, and the cpu budget it took is the caller's again). Keys carry an owner
number drawn once per optimizer, never ``id()``: an ``id`` is reused once its object is
collected, and a later optimizer then met a dead one's keys (found on the H200: a ring key still
held, "the key is held by a caller" at the next optimizer's first step). In a
child forked from the process that made it, ``step()``, ``state_dict()`` and
``load_state_dict()`` refuse (the worker thread does not exist there).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
import weakref
from contextlib import nullcontext as _nullcontext
from typing import Any, Iterable

import torch

from tiermem.names import (MOMENTS_DTYPES, PARAM_SYNCS, PLACEMENTS, STATE_TIERS, check_bool,
                           check_choice, check_fraction, check_int, check_number, parse_dtype)
from tiermem._graphs import refuse_capture
from tiermem.optim import distributed as _dist
from tiermem.optim.chunk_worker import ChunkWorker, stop_thread
from tiermem.optim.gpu_lane import GpuLane, fused_adam_, fused_adam_moments_
from tiermem.optim.hyperparams import check_dense_grad, check_group, check_groups
from tiermem.optim.param_watch import ParamWatch
from tiermem.optim.layout import (WIDE_BATCH_NUMEL, Group, StateLayout, free_owner_keys,
                                  local_view, private_store, wide_batches)
from tiermem.optim.partition import auto_chunk_numel, plan_group
from tiermem.optim.read_ahead import ReadAhead
from tiermem.optim.state_dict import param_states, scatter
from tiermem.optim.step_state import StepState, new_stats
from tiermem.store.store import StoreClosedError, TierStore
from tiermem.store.transfer import Copier


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
            in ``tiermem/optim/layout.py`` (needs ``store`` with an nvme tier).
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
        moments_dtype: dtype of the Adam moments, on the GPU side and the offloaded side
            alike: ``torch.float32`` (exact torch semantics) or ``torch.bfloat16`` (a deliberate
            precision trade: moments are computed in fp32 and rounded to bf16 after each update;
            the offloaded state falls from 12 to 8 B/param, the GPU side's from 8 to 4 B/param
            plus 4 for fp32 masters of non-fp32 params; masters stay fp32). Any spelling
            of :data:`tiermem.names.DTYPE_SPELLINGS` is accepted (``"bf16"``, ``"bfloat16"``,
            ``"fp32"``, ...); ``self.moments_dtype`` is the ``torch.dtype``.
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
            Costs ``LANE_SLOTS`` chunks of state and fp32 gradients in GPU memory.
        param_sync: when the updated offloaded params are waited for: ``"step"`` (default: in
            ``step()``, like any torch optimizer) or ``"forward"`` (in the next forward, per
            module, see Note [forward sync]; one process, CUDA or CPU).

    With ``data_parallel`` or FSDP2, ``step()``, ``state_dict()`` and ``load_state_dict()`` are
    collective: call them on every rank. A private store's spill directory is
    ``nvme_dir/rank{r}``.

    Raises:
        ValueError: a value out of range or not one of the choices (the arguments are checked by
            the helpers of :mod:`tiermem.names`, as :class:`tiermem.config.OptimizerConfig`
            checks the same fields), NVMe without a spill directory, params on several devices
            or on another device than ``store``, or a store without room, ``data_parallel``
            without torch.distributed or with FSDP2 params, ranks passing different params,
            each naming the field and the fix.
        TypeError: a number, int or flag of the wrong type (a bool where a number is wanted
            included), or a param that is not a floating-point leaf tensor.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, adamw: bool = True,
                 maximize: bool = False, offload_fraction: float = 1.0, state_tier: str = "cpu",
                 store: TierStore | None = None, nvme_dir: str | None = None, overlap: bool = True,
                 chunk_numel: int | None = None, max_grad_norm: float | None = None,
                 grad_accumulation_steps: int = 1,
                 moments_dtype: torch.dtype | str = torch.float32,
                 cpu_threads: int | None = None,
                 nvme_lookahead_chunks: int = 2, data_parallel: bool | None = None,
                 process_group: Any = None, bucket_numel: int = 1 << 23,
                 param_sync: str = "step", placement: str = "trace",
                 gpu_step_fraction: float = 0.0) -> None:
        # The shared checks of tiermem.names, as OptimizerConfig makes them: one spelling and one
        # message per value everywhere. The prefix is plain "HybridAdam: ": the rank prefix
        # (self._who) needs the mode, known only once the params are read.
        who = "HybridAdam: "
        check_number(who, "lr", lr, low=0.0)
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ValueError(f"HybridAdam: betas={betas!r} must be two numbers (the averaging "
                             f"coefficients of the gradient and of its square), e.g. (0.9, 0.999)")
        for i, beta in enumerate(betas):
            check_number(who, f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        check_number(who, "eps", eps, low=0.0)
        check_number(who, "weight_decay", weight_decay, low=0.0)
        check_bool(who, "adamw", adamw)
        check_bool(who, "maximize", maximize)
        offload_fraction = check_fraction(
            who, "offload_fraction", offload_fraction, "it is the fraction of parameter bytes "
            "whose optimizer state leaves the GPU (0.0 = none, 1.0 = all)")
        check_choice(who, "state_tier", state_tier, STATE_TIERS,
                     "cpu is pinned RAM, nvme spill files, split RAM up to the store's cpu budget "
                     "and the rest on NVMe")
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
        check_bool(who, "overlap", overlap)
        if chunk_numel is not None:
            check_int(who, "chunk_numel", chunk_numel, low=1024, unit="elements",
                      fix="or None to size it from the model")
        if max_grad_norm is not None:
            check_number(who, "max_grad_norm", max_grad_norm, low=0.0, low_open=True,
                         fix="or None for no clipping")
        check_int(who, "grad_accumulation_steps", grad_accumulation_steps, low=1,
                  fix="the backward passes per step()")
        moments_dtype = parse_dtype(who, "moments_dtype", moments_dtype, MOMENTS_DTYPES)
        if cpu_threads is not None:
            check_int(who, "cpu_threads", cpu_threads, low=1, unit="threads",
                      fix="or None for torch's thread count")
        check_int(who, "nvme_lookahead_chunks", nvme_lookahead_chunks, low=0, unit="chunks")
        if data_parallel is not None:
            check_bool(who, "data_parallel", data_parallel)
        check_int(who, "bucket_numel", bucket_numel, low=1, unit="elements",
                  fix="the elements per gradient-reduce bucket")
        check_choice(who, "param_sync", param_sync, PARAM_SYNCS,
                     "step: the updated params are ready when step() returns, forward: the next "
                     "forward waits per module")
        check_choice(who, "placement", placement, PLACEMENTS,
                     "trace: the split follows the gradient order of the first backward, given: "
                     "the order the params were given in")
        gpu_step_fraction = check_fraction(
            who, "gpu_step_fraction", gpu_step_fraction, "it is the share of the offloaded chunks "
            "the GPU steps by streaming their state through it (0.0: the CPU steps all)")
        if process_group is not None and data_parallel is False:
            raise ValueError("HybridAdam: process_group is given but data_parallel=False; drop "
                             "process_group, or set data_parallel=True to shard the state over it")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                        adamw=adamw)
        super().__init__(params, defaults)
        check_groups("HybridAdam", self.param_groups, max_grad_norm)  # inf, amsgrad
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
            group = Group(gi, params, plan_group(numels, sizes, self.offload_fraction, chunk_numel),
                          [0] * len(numels), len(numels), segments, numels=numels, sizes=sizes)
            if segments is not None:
                bucket_of = self._zero.groups[gi].bucket_of
                for li, seg in enumerate(segments):
                    group.locals_in_bucket.setdefault(bucket_of[seg.param], []).append(li)
            self._groups.append(group)
        self._owns_store = store is None
        if store is None:
            if state_tier == "nvme" and self._mode != "local":
                nvme_dir = _dist.rank_dir(nvme_dir)  # ranks on one host never share spill files
            store = private_store(self._groups, chunk_numel=chunk_numel,
                                  moments_dtype=moments_dtype,
                                  lookahead_chunks=nvme_lookahead_chunks, state_tier=state_tier,
                                  device=self.device, nvme_dir=nvme_dir)
        self._store = store
        self._layout = StateLayout(self._groups, store, owner=next(_OWNERS), device=self.device,
                                   state_tier=state_tier, moments_dtype=moments_dtype,
                                   backward_order=overlap and not (
                                       max_grad_norm is not None and self._mode == "local"),
                                   nvme_lookahead_chunks=nvme_lookahead_chunks,
                                   offload_fraction=self.offload_fraction, chunk_numel=chunk_numel)
        if not self._owns_store:
            self._layout.check_room()
        # Note [param changes]: parameters changed by the user are taken into the masters
        self._watch = ParamWatch(self._layout, self._who, active=self._mode == "local")
        self._layout.watch = self._watch
        self._copier = Copier(self.device)
        self._step = StepState()  # cross-thread step state: hooks, worker and caller share it
        self._last_stats = new_stats()
        self._moved0: dict = {}
        # Note [trace placement]: record the first backward's gradient order, plan at step()
        self._trace_placement = (placement == "trace" and self._mode == "local" and overlap
                                 and self.offload_fraction > 0.0)
        self._arrived: dict[tuple[int, int], int] = {}  # (g, i) -> arrival rank, under _step.lock
        self._state_ready = False
        self._read_ahead = ReadAhead(self._layout, self._step)
        # Note [gpu lane]: offloaded chunks the GPU steps by streaming their state through it
        self._lane = GpuLane(self._layout, self._step, self._read_ahead, self.param_groups,
                             self.gpu_step_fraction, self._copier.cuda)
        if not self._trace_placement:
            self._init_state()
            self._state_ready = True
        # param_sync="forward": a step() whose CPU side may still run (Note [forward sync])
        self._pending = False
        self._chunks_of = self._layout.param_chunks()
        # Note [lifetime]: threads and hooks never keep the optimizer alive
        self._worker = ChunkWorker(self._layout, self._step, self._read_ahead, self._lane,
                                   self._copier, self.param_groups, cpu_threads)
        me = weakref.ref(self)
        self._hooks: list = []  # removed by close() or the finalizer
        if self._mode == "local":
            self._hooks += [  # count backward passes always; ship early only with overlap
                g.params[i].register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, me, "_on_grad", g.index, i))
                for g in self._groups
                for i in (range(g.n_local) if self._trace_placement else g.plan.chunks_of_param)
                if g.params[i].requires_grad]  # frozen: shipped by step() if it has a grad
        elif self._mode == "zero":  # every gradient goes into a reduce bucket
            self._hooks += [
                p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, me, "_on_grad_dp", g.index, i))
                for g in self._groups for i, p in enumerate(g.params) if p.requires_grad]
        # FSDP2 assigns the sharded .grad itself: no hook fires, everything ships in step()
        if param_sync == "forward":
            # never traced by torch.compile: a traced hook's waits would happen at compile time
            # only, and a compiled forward would read params the CPU side has not written yet
            self._hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
                torch.compiler.disable(functools.partial(_call_weak_forward, me))))
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, self._worker.queue,
                                           self._worker.thread, self._hooks,
                                           self._layout.ram_held, self._store, self._owns_store,
                                           self._pid, self._layout.owner)
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

    def _grad_of(self, g: Group, i: int) -> torch.Tensor | None:
        """Flat gradient of local tensor ``i`` (data parallel: the averaged shard gradient),
        or ``None`` when it has none this step."""
        if g.segments is not None:
            s = g.segments[i]
            if self._zero.flags is not None and not self._zero.has_grad(g.index, s.param):
                return None
            return self._zero.shard_grad(g.index, i)
        grad = g.params[i].grad
        return None if grad is None else _dist.local_of(grad).view(-1)

    def _has_grad(self, g: Group, i: int) -> bool:
        if g.segments is not None:
            return self._zero.has_grad(g.index, g.segments[i].param)
        return g.params[i].grad is not None

    # ------------------------------------------------------------------ setup

    def _init_state(self) -> None:
        """Allocate the state (GPU side, store buffers and chunks, the lane's slots); on any
        failure (a full store or disk) undo all of it, so a later call starts afresh.

        Raises:
            TierFullError: the store has no room for a buffer or a chunk.
        """
        try:
            self._layout.alloc()
            self._lane.init()
            self._watch.record_all()  # the masters were copied from the params as they are
        except BaseException:
            self._layout.undo()
            self._lane.clear()
            raise

    def _ensure_state(self) -> None:
        """Note [trace placement]: plan from the recorded gradient order (when there is one)
        and allocate the state, once."""
        if self._state_ready:
            return
        with self._step.lock:
            arrived = dict(self._arrived)
        self._layout.replan(arrived)
        self._init_state()
        self._state_ready = True
        with self._step.stats_lock:  # the step's I/O counts from here: allocation is not streaming
            self._moved0 = dict(self._store.stats()["moved_bytes"])
        self._chunks_of = self._layout.param_chunks()
        self._read_ahead.plan_changed()
        with self._step.lock:
            self._step.chunk_missing = self._layout.params_per_chunk()
        self._read_ahead.first_chunks()

    def chunk_tiers(self) -> dict[str, int]:
        """Offloaded chunks per tier: ``{"cpu": n, "nvme": n}`` (where each one lives for good
        with ``state_tier`` ``"cpu"``, ``"nvme"`` or ``"split"``)."""
        self._ensure_state()
        return self._layout.chunk_tiers()

    # ------------------------------------------------------------------ backward side

    def _on_grad(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of an offloaded param: ship its grad on the last micro-batch."""
        check_dense_grad(self._who, g, i, self._groups[g].params[i])
        if self._pending:
            self._finish_step()  # a param unused in forward: its previous update completes first
        with self._step.lock:
            count = self._step.acc_count.get((g, i), 0) + 1
            self._step.acc_count[(g, i)] = count
            if not self._state_ready:  # Note [trace placement]: the first backward only records
                self._arrived.setdefault((g, i), len(self._arrived))
                return
            if (not self._layout.backward_order or count < self.grad_accumulation_steps
                    or (g, i) in self._step.shipped
                    or i not in self._groups[g].plan.chunks_of_param):
                return  # Note [stepping order]: else step() ships it, in forward order
        self._ship(g, i)

    def _on_grad_dp(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of every param with ``data_parallel``: on the last
        micro-batch, put its gradient in its reduce bucket; ship the shard pieces of the
        buckets that were reduced."""
        check_dense_grad(self._who, g, i, self._groups[g].params[i])
        with self._step.lock:
            count = self._step.acc_count.get((g, i), 0) + 1
            self._step.acc_count[(g, i)] = count
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
                    if li in group.plan.chunks_of_param and (g, li) not in self._step.shipped:
                        self._ship(g, li)

    def _ship(self, g: int, i: int) -> None:
        """Hand local tensor ``i``'s gradient to the CPU side: keep a reference and an event
        marking it complete on the current stream (its D2H is issued by the chunk worker), and
        queue the chunks it completes."""
        self._watch.sync(g, i)  # Note [param changes]: before any chunk of it can be stepped
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
        with self._step.lock:
            if self._mode == "local" and grad is not None:  # see _check_grads_untouched
                self._step.shipped_versions[(g, i)] = (group.params[i].grad._version,
                                                       group.params[i].grad.data_ptr())
            self._step.shipped.add((g, i))
            self._step.grad_refs[(g, i)] = ref
            for c in dict.fromkeys(group.plan.chunks_of_param[i]):
                self._step.chunk_missing[(g, c)] -= 1
                if self._step.chunk_missing[(g, c)] == 0:
                    ready_chunks.append((g, c))
        for item in ready_chunks:
            self._worker.enqueue(item)

    def _begin_step(self) -> None:
        self._step.reset(self._layout.params_per_chunk())
        self._watch.begin_step()
        self._worker.begin_step()
        if self._zero is not None:
            self._zero.begin_step()
        if self.max_grad_norm is None:
            self._step.compute_allowed.set()
        else:
            self._step.compute_allowed.clear()  # the CPU step needs the global norm first
        with self._step.stats_lock:
            self._step.stats = new_stats()
            self._moved0 = dict(self._store.stats()["moved_bytes"])
        self._read_ahead.first_chunks()

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
        with self._step.stats_lock:
            return dict(self._last_stats)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimizer step (see the module docstring for what overlaps).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        With ``data_parallel`` or FSDP2 params this is collective: every rank calls it.

        Raises:
            RuntimeError: the CPU step failed (the worker's error is chained; the message
                names the rank under torch.distributed), too many backward passes, a child
                forked from the process that made the optimizer, or a call inside a CUDA graph
                capture (Note [cuda graphs]).
            TierFullError: the first step could not allocate the state (no room in the store);
                nothing is left half-allocated, so a later step retries once there is room.
        """
        self._check_process()
        # the CPU step cannot be captured: Note [cuda graphs] (a param's device decides)
        refuse_capture("HybridAdam", "step()", _GRAPH_FIX, self._groups[0].params[0])
        if self._pending:
            self._finish_step()  # two steps without a forward between them
        try:  # Note [finite hyper-parameters]: nothing is stepped with a bad value
            check_groups(self._who, self.param_groups, self.max_grad_norm)
            for g in self._groups:
                for p_i, p in enumerate(g.params):
                    check_dense_grad(self._who, g.index, p_i, p)
        except (TypeError, ValueError):
            self._step.abandon()  # chunks shipped in backward fail rather than step
            self._begin_step()  # nothing was stepped; the next backward starts afresh
            raise
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
        self._step.freeze(self.param_groups)
        with self._step.lock:
            extra = [(k, n) for k, n in self._step.acc_count.items()
                     if n > self.grad_accumulation_steps]
        if extra:
            raise RuntimeError(
                f"{self._who}: {extra[0][1]} backward passes accumulated into a "
                f"parameter before step(), but grad_accumulation_steps="
                f"{self.grad_accumulation_steps}: gradients were copied off the GPU after pass "
                f"{self.grad_accumulation_steps}; set grad_accumulation_steps to the number of "
                f"backward passes per step")
        self._check_grads_untouched()
        self._check_params_before_step()
        if self._mode == "fsdp":
            self._layout.refresh_views()
        if self._zero is not None:  # buckets not reduced in backward, then the has-grad flags
            self._ship_buckets(self._zero.flush(lambda g, i: self._groups[g].params[i].grad))
        with self._zero.on_stream() if self._zero is not None else _nullcontext():
            for g in self._groups:
                for i in g.plan.chunks_of_param:
                    if (g.index, i) not in self._step.shipped:
                        self._ship(g.index, i)  # not shipped by a hook (no overlap / no grad / early step)
        if self._zero is not None:
            self._zero.join_stream()  # the GPU side and clipping read the reduced gradients
        if self.max_grad_norm is not None:
            self._clip(self.max_grad_norm)  # no gradient has been copied yet (the copies wait)
            if self._copier.cuda:
                clip_event = torch.cuda.Event()
                clip_event.record(self._copier.consumer_stream())  # D2H copies clipped grads
                self._step.clip_event = clip_event
        self._step.compute_allowed.set()
        with self._watch.writing((g.index, pc.param) for g in self._groups  # Note [param changes]
                                 for pc in g.plan.gpu_pieces):
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

    def _check_params_before_step(self) -> None:
        """Note [param changes]: take the changes of parameters not yet handed over this step
        into their masters; refuse a parameter changed after its gradient hook handed it over
        (the CPU side may have stepped it from the old value).

        Raises:
            RuntimeError: a parameter changed between its gradient hook and ``step()``.
            ValueError: a parameter changed its shape, dtype or device.
        """
        try:
            for g in self._groups:
                for i in range(g.n_local):
                    if not self._watch.checked(g.index, i):
                        self._watch.sync(g.index, i)
                    elif self._watch.changed(g.index, i):
                        raise RuntimeError(
                            f"{self._who}: param {i} of param group {g.index} was changed after "
                            f"backward had handed it to the CPU step (overlap=True), which may "
                            f"have stepped it from the old value; change parameters before the "
                            f"forward or after step(), or build HybridAdam with overlap=False. "
                            f"This step was not applied")
        except (RuntimeError, ValueError):
            self._step.abandon()  # chunks not yet stepped are not
            self._begin_step()
            raise

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
        # a replay would not wait: Note [cuda graphs] (a param's device decides)
        refuse_capture("HybridAdam", "the param_sync='forward' wait", _GRAPH_FIX,
                       self._groups[0].params[0])
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
        step = self._step
        with step.idle:
            while any(item not in step.chunk_h2d for item in chunks) and not step.errors:
                step.idle.wait()  # the worker has not stepped this module's chunks yet
            events = [step.chunk_h2d.get(item) for item in chunks]
            done = len(step.chunk_h2d) == len(step.chunk_missing) or bool(step.errors)
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
        step = self._step
        with step.idle:
            while step.outstanding:
                step.idle.wait()  # the CPU step of every offloaded chunk has to finish
            errors, step.errors = step.errors, []
            events = step.h2d_events
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
            self._zero.gather(lambda g: ([local_view(self._groups[g], i)
                                          for i in range(self._groups[g].n_local)],
                                         self._groups[g].params))
        raced = [(g.index, i) for g, i in self._stepped  # Note [param changes]
                 if i in g.plan.chunks_of_param and self._watch.changed(g.index, i)]
        for g, i in self._stepped:
            g.steps[i] += 1  # after the worker: it steps chunks with steps[i] + 1
        moved = self._store.stats()["moved_bytes"]
        with self._step.stats_lock:
            done = dict(self._step.stats, stall_s=stall, step_s=time.perf_counter() - t_step)
            done["nvme_read_bytes"] = moved.get("nvme->cpu", 0) - self._moved0.get("nvme->cpu", 0)
            done["nvme_write_bytes"] = moved.get("cpu->nvme", 0) - self._moved0.get("cpu->nvme", 0)
            self._last_stats = done
        self._begin_step()
        if raced:  # the step is complete; the changed values are taken at the next one
            raise RuntimeError(
                f"{self._who}: param {raced[0][1]} of param group {raced[0][0]} was changed while "
                f"the step was still updating it (param_sync='forward'), racing with its copy "
                f"back: call opt.synchronize() before changing parameters after step()")

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
        with self._step.lock:
            shipped = dict(self._step.shipped_versions)
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

    def _step_gpu_side(self, g: Group) -> None:
        """Step group ``g``'s GPU side with torch's fused Adam on the caller's stream. fp32
        moments and fp32 gradients: in place, in one call, no copies. Otherwise in batches of
        at most ``WIDE_BATCH_NUMEL`` elements (:func:`~tiermem.optim.layout.wide_batches`),
        each through :func:`fused_adam_moments_` with its gradients widened to fp32 for the
        call: bf16 moments are widened to fp32, stepped and rounded back (as the lane and the
        CPU kernel do), fp32 moments stepped in place; so the transient fp32 copies are at most
        12 B (bf16 moments) or 4 B (fp32 moments, gradients of bf16 params) x
        ``WIDE_BATCH_NUMEL``, not per GPU-side param. The update is elementwise and batches cut
        pieces at multiples of 16 (``WIDE_BATCH_NUMEL``'s docstring), so they change no bit."""
        hp = self.param_groups[g.index]
        idx = [k for k, pc in enumerate(g.plan.gpu_pieces) if self._has_grad(g, pc.param)]
        if not idx:
            return
        grads = []  # in the model dtype: non-fp32 gradients are widened per batch below
        for k in idx:
            pc = g.plan.gpu_pieces[k]
            grads.append(self._grad_of(g, pc.param).detach()[pc.start:pc.start + pc.numel])
        masters = [g.gpu_masters[k] for k in idx]
        steps = [g.gpu_steps[k] for k in idx]
        torch._foreach_add_(steps, 1)
        if self.moments_dtype == torch.float32 and all(gr.dtype == torch.float32 for gr in grads):
            fused_adam_(masters, grads, [g.gpu_exp_avg[k] for k in idx],
                        [g.gpu_exp_avg_sq[k] for k in idx], steps, hp)
        else:  # something to widen: WIDE_BATCH_NUMEL elements at a time
            for batch in wide_batches([m.numel() for m in masters], WIDE_BATCH_NUMEL):
                fused_adam_moments_(
                    [masters[j][lo:hi] for j, lo, hi in batch],
                    [grads[j][lo:hi].float() for j, lo, hi in batch],
                    [g.gpu_exp_avg[idx[j]][lo:hi] for j, lo, hi in batch],
                    [g.gpu_exp_avg_sq[idx[j]][lo:hi] for j, lo, hi in batch],
                    [steps[j] for j, _, _ in batch], hp)
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
        self._step.drain()
        for g in self._groups:  # Note [param changes]: the masters of changed params
            for i in range(g.n_local):
                self._watch.sync(g.index, i, mark=False)
        states = param_states(self._layout, self._mode, self._zero, self.device)
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
        self._step.drain()
        groups = state_dict["param_groups"]
        for gi, saved in enumerate(groups):  # Note [finite hyper-parameters]: no amsgrad
            check_group(f"{self._who}.load_state_dict", gi, saved)
            if any("max_exp_avg_sq" in (state_dict["state"].get(sid) or {})
                   for sid in saved["params"]):
                raise ValueError(f"{self._who}.load_state_dict: param group {gi} holds an "
                                 f"amsgrad state (max_exp_avg_sq); HybridAdam does not "
                                 f"implement amsgrad: continue it with torch.optim.AdamW("
                                 f"amsgrad=True)")
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
            self._check_grads_untouched()
            if self._mode == "fsdp":
                self._layout.refresh_views()
            scatter(self._layout, g, sts, self._mode, self._who)
        self._watch.record_all()  # Note [param changes]: the masters are the loaded ones

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

    @property
    def store(self) -> TierStore:
        """The store of the offloaded state: the one given, or the private one made for it
        (closed by :meth:`close`)."""
        return self._store

    def memory_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes per place: ``{"gpu": ..., "cpu": ..., "nvme": ...}``."""
        self._ensure_state()
        gpu = self._layout.gpu_state_bytes() + self._lane.device_bytes()
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


_GRAPH_FIX = ("capture the model's forward and backward with torch.cuda.make_graphed_callables "
              "(its gradients accumulate after each replay, outside the graph, so these hooks run "
              "eagerly), with param_sync='step', and call step() outside any capture")
_OWNERS = itertools.count()  # Note [lifetime]: the owner number in a HybridAdam's store keys


def _grad_hook(ref: weakref.ref, method: str, g: int, i: int, param: torch.Tensor) -> None:
    """A post-accumulate-grad hook's body: ``method(g, i)`` of the optimizer if it still exists
    (Note [lifetime])."""
    refuse_capture("HybridAdam", "a gradient hook", _GRAPH_FIX, param)  # Note [cuda graphs]
    opt = ref()
    if opt is not None:
        getattr(opt, method)(g, i)


def _call_weak_forward(ref: weakref.ref, module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook (param_sync="forward") through a weak reference."""
    opt = ref()
    if opt is not None:
        opt._before_forward(module, args)


def _release(work: queue.Queue, worker: threading.Thread, hooks: list, ram_held: list,
             store: TierStore, owns_store: bool, pid: int, owner: int) -> None:
    """Finalizer of a HybridAdam (and the end of ``close()``): stop the worker, remove the
    hooks, release held RAM chunks, then close a private store or free this optimizer's keys in
    a caller's. Runs once; holds no reference to the optimizer (Note [lifetime]). In a forked
    child (no worker there, its queue's lock may have been copied held) it only lets a private
    store forget the child's copy."""
    if os.getpid() != pid:
        if owns_store:
            store.close()  # Note [fork] of the store: the parent's files stay
        return
    stop_thread(work, worker)
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
        return
    if store.device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(store.device)  # no copy still reads or writes a blob freed below
    try:
        free_owner_keys(store, owner)
    except StoreClosedError:
        pass  # the caller closed its store first: nothing is left to free
