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
   that module uses (Note [forward sync] in ``forward_sync.py``), so the CPU step of the last
   layers' chunks overlaps the first layers' forward.

One offloaded chunk passes through five files: this one (the gradient hook ``_on_grad`` and
``_ship``, then ``step()``), ``chunk_worker.py`` (copy to host, step, copy back),
``tiermem/store/transfer.py`` (the copies), ``cpu_adam.py`` (the CPU kernel) and ``layout.py``
(where its state and ring slots live); ``step_state.py`` lists the fields they share. What
differs between one process, data parallel and FSDP2 is a :class:`~tiermem.optim.modes.Mode`
chosen once at construction (``modes.py``; the distributed ones in ``dist_modes.py``, never
imported by a single-process run). The GPU lane is in ``gpu_lane.py`` (Note [gpu lane]);
arguments are checked in ``arguments.py``, ``step()``'s refusals in ``step_checks.py``; the
finalizer and weak hooks are in ``lifetime.py`` (Note [lifetime]); the groups, a private store
and when the state is allocated in ``state_setup.py`` (Note [trace placement]); the end of
``step()`` (the GPU side's fused Adam, waiting for the CPU side) in ``step_tail.py``.

Note [hybrid step]: a parameter's post-accumulate-grad hook fires after every use of that
parameter in the current backward has been enqueued; the event it records there is what the
D2H copy waits for, and the worker waits for the D2H to finish before stepping, so the H2D that
overwrites the parameter can never race with backward reading it. Gradient clipping needs the
global norm before any update, so with ``max_grad_norm`` no gradient is copied before
``step()`` has clipped them all on the GPU (the copies wait for the clip), unless the step
speculates (Note [speculative step]; the order in one process: Note [stepping order]).

Note [stepping order]: the offloaded chunks are stepped in the order their gradients complete
(backward order: the last layers first) when that lets the CPU step overlap backward. With
``max_grad_norm`` in one process nothing can be stepped before ``step()`` has the global norm
(unless it speculates: Note [speculative step]), so the hooks only count, ``step()`` ships
every gradient in execution order, the worker steps in forward order: the order the next
forward needs them in with ``param_sync="forward"`` (Note [forward sync]; the first layers'
state is on the GPU side, stepped at once). The NVMe read-ahead, the split tier's RAM choice and
the GPU lane's share follow the same order (``StateLayout.expected_order``). With data parallel
or FSDP2 the reduce buckets and FSDP's hooks keep backward order.

Several ranks (torch.distributed): ``data_parallel=True`` (ZeRO-1/2) and FSDP2 params, see
``tiermem/optim/dist_modes.py``.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from typing import Any, Iterable

import torch

from tiermem import options
from tiermem._graphs import refuse_capture
from tiermem.optim.amp_scaling import drops_scaler_step_on_error, settle_step, take_scaler
from tiermem.optim.arguments import check_arguments, check_store_device, params_device
from tiermem.optim.chunk_worker import ChunkWorker
from tiermem.optim.forward_sync import ModelHooks, wait_for_module
from tiermem.optim.gpu_lane import GpuLane
from tiermem.optim.hyperparams import check_dense_grad, check_groups
from tiermem.optim.local_tensor import is_dtensor
from tiermem.optim.modes import GRAPH_FIX as _GRAPH_FIX, LocalMode, Mode
from tiermem.optim.param_watch import ParamWatch
from tiermem.optim.layout import Group, StateLayout
from tiermem.optim.lifetime import OWNERS, call_weak_forward, claim_params, release
from tiermem.optim.read_ahead import ReadAhead
from tiermem.optim.speculate import Speculation
from tiermem.optim.state_dict import (check_loadable, hyper_params_of, scatter, torch_format,
                                      with_grad_order)
from tiermem.optim.state_setup import ensure_state, init_state, make_groups, private_store_for
from tiermem.optim.step_checks import (check_accumulation, check_grads_untouched,
                                        check_params_before_step, hold_for_late_hyperparams,
                                        refuse_skipped_step, refuse_stale_hyperparams,
                                        shipped_mark)
from tiermem.optim.step_state import StepState, new_stats
from tiermem.optim.step_tail import finish_step, refuse_after_failure, step_gpu_side
from tiermem.optim.streamed import stand_ins, streamed_mode
from tiermem.store.store import TierStore
from tiermem.store.transfer import Copier

_D = options.defaults("optimizer", "api")
"""HybridAdam's defaults, from the one definition (Note [one definition] in tiermem/options.py)."""


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
            ``step()``; under a GradScaler with ``rollback_bytes``: Note [grad scaler overlap]).
        chunk_numel: elements per offloaded chunk (the unit of the CPU step and NVMe I/O);
            ``None``: 1/32 of the offloaded elements rounded down to a power of two, within
            [2^16, 2^24] (per-chunk costs vanish in 16M chunks, while 32 chunks keep the CPU
            step overlapping backward).
        max_grad_norm: clip gradients to this global 2-norm in ``step()`` (correct for grads
            already copied off the GPU); ``None``: no clipping.
        rollback_bytes: host RAM (bytes, or ``"4GiB"``) for pre-step copies of chunk state, so
            that with ``max_grad_norm`` chunks step during backward and are rolled back when the
            norm clips (Note [speculative step] in ``speculate.py``); 0: they wait for the norm.
            The GPU lane's share is held in GPU memory (Note [lane rollback on the GPU]).
        grad_accumulation_steps: backward passes per step; gradients leave the GPU in the last.
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
        bucket_numel: elements per gradient-reduce bucket (``data_parallel``), reduced when full.
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
        ValueError: a value out of range or not one of the choices (each argument's default and
            check are defined once in :mod:`tiermem.options`, which
            :class:`tiermem.config.OptimizerConfig` uses too), NVMe without a spill directory,
            params on several devices or on another device than ``store``, or a store without
            room, ``data_parallel`` without torch.distributed or with FSDP2 params, ranks
            passing different params, each naming the field and the fix.
        TypeError: a number, int or flag of the wrong type (a bool where a number is wanted
            included), or a param that is not a floating-point leaf tensor.
    """

    def __init__(self, params: Iterable, lr: float = _D["lr"],
                 betas: tuple[float, float] = _D["betas"], eps: float = _D["eps"],
                 weight_decay: float = _D["weight_decay"], *, adamw: bool = _D["adamw"],
                 maximize: bool = _D["maximize"], offload_fraction: float = _D["offload_fraction"],
                 state_tier: str = _D["state_tier"], store: TierStore | None = None,
                 nvme_dir: str | None = _D["nvme_dir"], overlap: bool = _D["overlap"],
                 chunk_numel: int | None = _D["chunk_numel"],
                 max_grad_norm: float | None = _D["max_grad_norm"],
                 grad_accumulation_steps: int = _D["grad_accumulation_steps"],
                 moments_dtype: torch.dtype | str = _D["moments_dtype"],
                 cpu_threads: int | None = _D["cpu_threads"],
                 nvme_lookahead_chunks: int = _D["nvme_lookahead_chunks"],
                 data_parallel: bool | None = _D["data_parallel"], process_group: Any = None,
                 bucket_numel: int = _D["bucket_numel"], param_sync: str = _D["param_sync"],
                 placement: str = _D["placement"],
                 gpu_step_fraction: float = _D["gpu_step_fraction"],
                 rollback_bytes: int | str = _D["rollback_bytes"]) -> None:
        offload_fraction, moments_dtype, gpu_step_fraction = check_arguments(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
            maximize=maximize, offload_fraction=offload_fraction, state_tier=state_tier,
            store=store, nvme_dir=nvme_dir, overlap=overlap, chunk_numel=chunk_numel,
            max_grad_norm=max_grad_norm, grad_accumulation_steps=grad_accumulation_steps,
            moments_dtype=moments_dtype, cpu_threads=cpu_threads,
            nvme_lookahead_chunks=nvme_lookahead_chunks, data_parallel=data_parallel,
            process_group=process_group, bucket_numel=bucket_numel, param_sync=param_sync,
            placement=placement, gpu_step_fraction=gpu_step_fraction)
        rollback_bytes = options.check("optimizer.rollback_bytes", options.Who("HybridAdam: "),
                                       rollback_bytes)  # Note [one definition]
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                        adamw=adamw)
        super().__init__(params, defaults)
        check_groups("HybridAdam", self.param_groups, max_grad_norm)  # inf, amsgrad
        all_params = [p for g in self.param_groups for p in g["params"]]
        self.device = params_device(stand_ins(all_params))  # Note [streamed write-back]
        self._mode: Mode = choose_mode(all_params, data_parallel, process_group, bucket_numel)
        self._who = self._mode.who
        claim_params(self, all_params, self._who)  # Note [one optimizer per param]
        self._step_supports_amp_scaling = self._mode.one_process  # Note [grad scaler]
        if param_sync == "forward" and not self._mode.one_process:
            raise ValueError(f"{self._who}: param_sync='forward' works in one process only; "
                             f"with data_parallel or FSDP2 use param_sync='step'")
        self.param_sync = param_sync
        check_store_device(store, self.device)
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
        self._mode.attach(self.param_groups, self.device)  # collective when distributed
        self._groups, self.chunk_numel = make_groups(self._mode, self.param_groups,
                                                     self.offload_fraction, chunk_numel)
        self._mode.bind(self._groups, max_grad_norm)  # streamed weights: their host copies
        chunk_numel = self.chunk_numel
        self._owns_store = store is None
        self._store = store if store is not None else private_store_for(self, nvme_dir)
        store = self._store
        self._layout = StateLayout(self._groups, store, owner=next(OWNERS), device=self.device,
                                   state_tier=state_tier, moments_dtype=moments_dtype,
                                   backward_order=overlap and not (
                                       max_grad_norm is not None and self._mode.one_process),
                                   nvme_lookahead_chunks=nvme_lookahead_chunks,
                                   offload_fraction=self.offload_fraction, chunk_numel=chunk_numel)
        if not self._owns_store:
            self._layout.check_room()
        # Note [param changes]: parameters changed by the user are taken into the masters
        self._watch = ParamWatch(self._layout, self._who, active=self._mode.one_process)
        self._layout.watch = self._watch
        self._copier = Copier(self.device)
        self._step = StepState()  # cross-thread step state: hooks, worker and caller share it
        # Note [gradient writes after a forward-synced step]: kept with param_sync="forward" only
        self._step.reads.enabled = param_sync == "forward"
        self._last_stats = new_stats()
        self._moved0: dict = {}
        # Note [trace placement]: record the first backward's gradient order, plan at step()
        self._trace_placement = (placement == "trace" and self._mode.one_process and overlap
                                 and self.offload_fraction > 0.0)
        self._arrived: dict[tuple[int, int], int] = {}  # (g, i) -> arrival rank, under _step.lock
        self._state_ready = False
        self._read_ahead = ReadAhead(self._layout, self._step)
        self._spec = self._step.speculation = Speculation(  # Note [speculative step]
            self._layout, self._step, self._read_ahead, rollback_bytes=rollback_bytes,
            clipping=max_grad_norm is not None, overlap=overlap,
            one_process=self._mode.one_process, who=self._who, mode=self._mode.name)
        # Note [gpu lane]: offloaded chunks the GPU steps by streaming their state through it
        self._lane = GpuLane(self._layout, self._step, self._read_ahead, self.param_groups,
                             self.gpu_step_fraction, self._copier.cuda)
        if not self._trace_placement:
            init_state(self)
            self._state_ready = True
        # param_sync="forward": a step() whose CPU side may still run (Note [forward sync])
        self._pending = False
        self._failed = None  # a failed CPU step's error: Note [failed steps] in step_tail.py
        # the loop sets hyper-parameters after backward: chunks wait for step()
        self._late_hp = False  # (Note [late hyper-parameters] in hyperparams.py)
        self._chunks_of = self._layout.param_chunks()
        # Note [lifetime]: threads and hooks never keep the optimizer alive
        self._worker = ChunkWorker(self._layout, self._step, self._read_ahead, self._lane,
                                   self._copier, self.param_groups, cpu_threads)
        self._hooks = self._register_hooks()  # removed by close() or the finalizer
        # Note [model state dicts after a forward-synced step]
        self._model_hooks = ModelHooks(weakref.ref(self), set(self._chunks_of), self._hooks)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, release, self._worker.queue,
                                           self._worker.thread, self._hooks,
                                           self._layout.ram_held, self._store, self._owns_store,
                                           self._pid, self._layout.owner)
        self._begin_step()

    # ------------------------------------------------------------------ setup

    def _register_hooks(self) -> list:
        """The mode's gradient hooks and, with ``param_sync="forward"``, the global forward
        pre-hook; each calls the optimizer through a weak reference (Note [lifetime])."""
        me = weakref.ref(self)
        hooks = self._mode.grad_hooks(me, self._groups, self._trace_placement)
        if self.param_sync == "forward":
            # never traced by torch.compile: a traced hook's waits would happen at compile time
            # only, and a compiled forward would read params the CPU side has not written yet
            hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(
                torch.compiler.disable(functools.partial(call_weak_forward, me))))
        return hooks

    def chunk_tiers(self) -> dict[str, int]:
        """Offloaded chunks per tier: ``{"cpu": n, "nvme": n}`` (where each one lives for good
        with ``state_tier`` ``"cpu"``, ``"nvme"`` or ``"split"``)."""
        ensure_state(self)
        return self._layout.chunk_tiers()

    # ------------------------------------------------------------------ backward side

    def _on_grad(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of an offloaded param: ship its grad on the last micro-batch."""
        check_dense_grad(self._who, g, i, self._groups[g].params[i])
        if self._pending:
            self._finish_step()  # a param unused in forward: its previous update completes first
        self._step.note_backward(self.param_groups)  # Note [late hyper-parameters]
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

    def _ship(self, g: int, i: int, ready: Any = None) -> None:
        """Hand local tensor ``i``'s gradient to the CPU side: keep a reference and an event
        marking it complete (``ready``, a streamed host gradient's D2H event, else recorded on
        the current stream for a device gradient: the chunk worker issues its D2H), and queue
        the chunks it completes."""
        self._watch.sync(g, i)  # Note [param changes]: before any chunk of it can be stepped
        group = self._groups[g]
        grad = self._mode.grad_of(group, i)
        ref = None
        if grad is not None:
            if ready is None and grad.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))  # the D2H waits for the grad
            ref = (grad.detach(), ready)
        ready_chunks = []
        with self._step.lock:
            if self._mode.one_process and grad is not None:  # Note [gradient checksums]
                self._step.shipped_versions[(g, i)] = shipped_mark(grad, ready, self._step)
            self._step.shipped.add((g, i))
            self._step.grad_refs[(g, i)] = ref
            for c in dict.fromkeys(group.plan.chunks_of_param[i]):
                self._step.chunk_missing[(g, c)] -= 1
                if self._step.chunk_missing[(g, c)] == 0:
                    ready_chunks.append((g, c))
        for item in ready_chunks:
            self._worker.enqueue(item)

    def _begin_step(self) -> None:
        with torch.inference_mode(False), torch.no_grad():  # Note [completion in inference mode]
            self._reset_step()

    def _reset_step(self) -> None:
        self._step.reset(self._layout.params_per_chunk())
        self._watch.begin_step()
        self._worker.begin_step()
        self._mode.begin_step()
        if self.max_grad_norm is None and not self._spec.amp.holds() and not self._late_hp:
            self._step.compute_allowed.set()
        else:  # the CPU step needs the global norm or the GradScaler's verdict first
            self._step.compute_allowed.clear()  # (Note [grad scaler overlap]), or the
            self._spec.begin_step(self._state_ready)  # or speculates: Note [speculative step]
            if self._late_hp:  # step()'s hyper-parameters: Note [late hyper-parameters]
                self._spec.active = False  # (the worker is idle: nothing admitted yet)
        with self._step.stats_lock:
            self._step.stats = new_stats()
            self._moved0 = dict(self._store.stats()["moved_bytes"])
        self._read_ahead.first_chunks()

    def step_stats(self) -> dict:
        """Breakdown of the last completed ``step()`` (backward hooks included), reset each step.

        ``cpu_adam_s``: seconds of the CPU Adam kernel summed over chunks (worker thread);
        ``worker_s``: seconds the worker spent on chunks (kernel, copy waits, bookkeeping),
        ``copy_wait_s``: of which D2H and ring-slot waits (the rest: Note [worker phases]);
        ``d2h_bytes`` / ``h2d_bytes``: offloaded gradients copied off / updated params copied
        back (for chunks on the GPU lane: their state, both ways); ``gpu_chunks``: chunks the
        GPU lane stepped (Note [gpu lane]); ``nvme_read_bytes`` / ``nvme_write_bytes``: the
        store's nvme->cpu / cpu->nvme traffic during the step (all of the store's traffic, if
        it is shared);
        ``stall_s``: time ``step()`` waited for the CPU worker after stepping the GPU side;
        ``step_s``: wall time of ``step()``; ``chunks``: offloaded chunks stepped (a re-step
        after a rollback counts again); ``speculated_chunks`` / ``rolled_back_chunks`` /
        ``rollback_held_bytes`` (of which ``rollback_gpu_bytes`` on the GPU) and ``speculating``
        (1: the step speculated, 0: not): Note [speculative step] (``speculate.py``).
        """
        with self._step.stats_lock:
            return dict(self._last_stats)

    # ------------------------------------------------------------------ step

    @drops_scaler_step_on_error  # a refused step leaves no grad_scale: Note [grad scaler]
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimizer step (see the module docstring for what overlaps).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        With ``data_parallel`` or FSDP2 params this is collective: every rank calls it.

        Raises:
            RuntimeError: the CPU step failed (the worker's error is chained; the message
                names the rank under torch.distributed), or an earlier one did and the state
                was not loaded since (Note [failed steps]), too many backward passes, gradients
                changed after backward or a GradScaler with overlap (Note [grad scaler]), a
                forked child, or a call inside a CUDA graph capture (Note [cuda graphs]).
            TierFullError: the first step could not allocate the state (no room in the store);
                nothing is left half-allocated, so a later step retries once there is room.
        """
        self._check_process()
        # the CPU step cannot be captured: Note [cuda graphs] (a param's device decides)
        refuse_capture("HybridAdam", "step()", _GRAPH_FIX, self._groups[0].params[0])
        self._step.backward_seen = False  # this backward's step: Note [skipped steps]
        if self._pending:
            self._finish_step()  # two steps without a forward between them
        if self._failed is not None:  # Note [failed steps]: this backward's chunks step nothing
            self._step.abandon()
            self._begin_step()
            refuse_after_failure(self, "step()")
        try:  # Note [finite hyper-parameters]: nothing is stepped with a bad value
            check_groups(self._who, self.param_groups, self.max_grad_norm)
            for g in self._groups:
                for p_i, p in enumerate(g.params):
                    check_dense_grad(self._who, g.index, p_i, p)
        except (TypeError, ValueError):
            self._step.abandon()  # chunks shipped in backward fail rather than step
            self._begin_step()  # nothing was stepped; the next backward starts afresh
            raise
        if take_scaler(self, self._step, self._who, self._begin_step):  # Note [grad scaler]
            return None  # a GradScaler found an inf/NaN gradient: skipped, as torch skips it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t_step = time.perf_counter()
        try:
            ensure_state(self)  # Note [trace placement]: the first step plans and allocates
        except BaseException:
            self._begin_step()  # undone: the next backward and step start afresh
            raise
        # chunks stepped from now on use this step's hyper-parameters, even when an LR
        # scheduler changes them before the worker is done (param_sync="forward")
        self._step.freeze(self.param_groups)
        try:  # a refused step wakes and fails the chunks waiting for it (held, clipping)
            check_accumulation(self._step, self.grad_accumulation_steps, self._who)
            check_grads_untouched(self._step, self._groups, self._who)
            stale, late = self._step.late_changes()  # Note [late hyper-parameters]
            self._late_hp = hold_for_late_hyperparams(self._who, stale, late, self._late_hp)
            refuse_stale_hyperparams(self._who, stale)
            check_params_before_step(self._watch, self._groups, self._who)
        except (RuntimeError, ValueError):
            self._step.abandon()  # chunks not yet stepped are not
            self._begin_step()
            raise
        self._mode.ship_rest(self, self._ship_rest)
        # unscale, clip; keep or roll back the speculative steps (Note [speculative step])
        settle_step(self)  # Note [grad scaler overlap]
        self._step.compute_allowed.set()
        with self._watch.writing((g.index, pc.param) for g in self._groups  # Note [param changes]
                                 for pc in g.plan.gpu_pieces):
            for g in self._groups:
                self._step_gpu_side(g)
        self._t_step = t_step
        self._stepped = [(g, i) for g in self._groups for i in range(g.n_local)  # before zero_grad
                         if self._mode.has_grad(g, i)]
        if self.param_sync == "forward":
            self._pending = True  # the next forward waits per module (Note [forward sync])
            # Note [gradient writes after a forward-synced step]: the bytes still to be read
            self._step.reads.watch(self._step, self._groups, self._copier.consumer_stream())
            return loss
        self._finish_step()
        return loss

    def _ship_rest(self) -> None:
        """Ship every gradient no hook shipped (no overlap / no grad / early step)."""
        for g in self._groups:
            for i in g.plan.chunks_of_param:
                if (g.index, i) not in self._step.shipped:
                    self._ship(g.index, i)

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
        ``model.zero_grad(set_to_none=False)`` bypasses this: call ``synchronize()`` before
        it, or the completion refuses a gradient it zeroed before the CPU side read it (Note
        [gradient writes after a forward-synced step] in grad_reads.py).

        After a backward without ``step()`` (a skipped step) the step is abandoned: exact when
        none of its chunks could be stepped during backward, else refused (Note [skipped
        steps] in step_checks.py).

        Raises:
            RuntimeError: the CPU step being completed failed, or a skipped step's chunks may
                have been stepped during backward (the gradients are reset first).
        """
        if not set_to_none:
            self.synchronize()
        could_step = False
        if self._step.backward_seen and not self._pending:  # Note [skipped steps]
            with self._step.lock:
                could_step = bool(self._step.shipped) and self._step.compute_allowed.is_set()
            self._step.abandon()  # chunks not yet stepped are not; speculated ones go back
            self._begin_step()
        super().zero_grad(set_to_none=set_to_none)
        refuse_skipped_step(self._who, could_step)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook (param_sync="forward"): wait for this module's params."""
        # a replay would not wait: Note [cuda graphs] (a param's device decides)
        refuse_capture("HybridAdam", "the param_sync='forward' wait", _GRAPH_FIX,
                       self._groups[0].params[0])
        self._model_hooks.see(module)  # Note [model state dicts after a forward-synced step]
        if not self._pending:
            return
        # Note [forward sync]: done is every chunk, so the whole step completes here
        if wait_for_module(self._step, self._chunks_of, module, self._copier.consumer_stream()):
            self._finish_step()

    def _finish_step(self) -> None:
        """Complete the last ``step()``: :func:`~tiermem.optim.step_tail.finish_step`."""
        finish_step(self)

    def _step_gpu_side(self, g: Group) -> None:
        """Step group ``g``'s GPU side: :func:`~tiermem.optim.step_tail.step_gpu_side`."""
        step_gpu_side(g, self.param_groups[g.index], self._mode, self.moments_dtype)

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
            RuntimeError: a forked child; chunks stepped before step() (Note [state between steps]);
                a failed CPU step since the state was last loaded (Note [failed steps]).
            TierFullError: the state could not be allocated yet (first use) and the store has
                no room; nothing is left half-allocated, so it can be retried.
        """
        self._check_process()
        self.synchronize()
        refuse_after_failure(self, "state_dict()")  # Note [failed steps]: a mixed state
        ensure_state(self)
        self._step.drain(f"{self._who}.state_dict()")  # Note [state between steps]
        for g in self._groups:  # Note [param changes]: the masters of changed params
            for i in range(g.n_local):
                self._watch.sync(g.index, i, mark=False)
        out = torch_format(self._mode.param_states(self._layout, self.device), self.param_groups)
        if not self._trace_placement:
            return out
        with self._step.lock:
            arrived = dict(self._arrived)
        return with_grad_order(out, arrived)  # Note [saved gradient order]

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from :meth:`state_dict` (or torch.optim.Adam/AdamW's ``state_dict``).

        Any world size: full tensors are cut to this rank's shard (data parallel, FSDP2);
        DTensors (FSDP2, e.g. loaded by ``torch.distributed.checkpoint``) are redistributed to
        the params' placements.

        Raises:
            ValueError: the number of groups or params, or a tensor's shape, does not match.
            RuntimeError: a forked child; chunks stepped before step() (Note [state between steps]).
        """
        self._check_process()
        self.synchronize()
        ensure_state(self, state_dict)  # Note [saved gradient order]
        self._step.drain(f"{self._who}.load_state_dict()")
        groups = state_dict["param_groups"]
        check_loadable(state_dict, self._groups, self._who)
        for saved, hp in zip(groups, self.param_groups):
            hp.update(hyper_params_of(saved))  # Note [saved weight decay style]
        for saved, g in zip(groups, self._groups):
            sts = [state_dict["state"].get(sid) for sid in saved["params"]]
            check_grads_untouched(self._step, self._groups, self._who)
            self._mode.refresh_views(self._layout)
            try:
                scatter(self._layout, g, sts, self._mode.local_state)
            except BaseException as exc:  # part loaded: Note [failed steps] refuses the mix
                self._failed = exc
                raise
        self._watch.record_all()  # Note [param changes]: the masters are the loaded ones
        self._failed = None  # Note [failed steps]: the state is one step's again

    def check_state_dict(self, state_dict: dict) -> None:
        """Refuse ``state_dict`` as :meth:`load_state_dict` would, loading nothing (so that
        ``tiermem.checkpoint.load_checkpoint`` refuses before it touches the model: Note
        [checkpoint fit]). Allocates this optimizer's state if it is not yet (a load would),
        so that a store without room for it says so here.

        Raises:
            ValueError: a bad or amsgrad hyper-parameter group, another number of groups or
                params, or a tensor whose shape is not its param's.
            TierFullError: no room for the optimizer's state in its store.
            RuntimeError: a forked child.
        """
        self._check_process()
        ensure_state(self, state_dict)  # Note [saved gradient order]
        check_loadable(state_dict, self._groups, self._who)

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
        ensure_state(self)
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
        if getattr(self, "_lane", None) is not None:  # the worker is stopped: nothing steps
            self._spec.free()  # Note [lane rollback on the GPU]: its host and device copies
            self._lane.clear()  # and the lane's device slots


def choose_mode(params: list[torch.Tensor], data_parallel: bool | None, process_group: Any,
                bucket_numel: int) -> Mode:
    """The mode of ``params`` (:mod:`tiermem.optim.modes`): FSDP2 for DTensors, data parallel
    when asked, else one process, which never imports the distributed code.

    Raises:
        ValueError: DTensors with ``data_parallel``/``process_group``, a mix of DTensors and
            plain params, or ``data_parallel`` without an initialized torch.distributed.
    """
    dp = bool(data_parallel) or process_group is not None
    if dp or any(is_dtensor(p) for p in params):
        streamed_mode(params, True)  # refuses streamed weights
        from tiermem.optim import dist_modes  # only a distributed run imports the distributed code
        return dist_modes.choose(params, dp, process_group, bucket_numel)
    return streamed_mode(params, False) or LocalMode()
