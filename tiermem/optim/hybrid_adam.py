"""HybridAdam: Adam/AdamW whose state is split between the GPU and pinned host RAM or NVMe.

A ``torch.optim.Optimizer``: LR schedulers, ``zero_grad``, param groups and ``state_dict`` work
as usual. Per param group, the first ``1 - offload_fraction`` of the bytes (execution order: the
first layers) keep fp32 masters and moments on the GPU and step there with torch's fused Adam;
the rest (the offloaded side) keeps them in the TierStore's ``"cpu"`` tier (pinned) or streams
them through its ``"nvme"`` tier, and steps on the CPU with tiermem's native kernel.

How one step overlaps (``overlap=True``), see Note [hybrid step]:
1. backward: a post-accumulate-grad hook copies each offloaded gradient D2H into a pinned
   buffer on a dedicated stream as soon as it is accumulated (last micro-batch only);
2. a worker thread steps each offloaded chunk on the CPU as soon as all its gradients have
   landed (gradients arrive last-layer-first, so the later layers' chunks step during backward),
   writing the updated params in the model dtype into a pinned buffer in the same pass, and
   copies them H2D on their own stream straight into the parameters;
3. ``step()`` steps the GPU side, waits for the worker, and makes the caller's stream wait on
   the H2D copies (no device-wide synchronisation).

Note [hybrid step]: a parameter's post-accumulate-grad hook fires after every use of that
parameter in the current backward has been enqueued, and the D2H copy waits for the compute
stream at that point; the worker waits for the D2H to finish before stepping, so the H2D that
overwrites the parameter can never race with backward reading it. Gradient clipping needs the
global norm before any update, so with ``max_grad_norm`` the CPU step waits for ``step()``.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from tiermem.config import StoreConfig
from tiermem.optim.cpu_adam import adam_step_
from tiermem.optim.partition import Chunk, GroupPlan, plan_group
from tiermem.store.pool import round_up
from tiermem.store.store import TierStore
from tiermem.store.transfer import Copier


def _state_numel(numel: int, moments_dtype: torch.dtype) -> int:
    """fp32 elements of one chunk's state blob: the master, then both moments."""
    return numel * (3 if moments_dtype == torch.float32 else 2)


def _state_views(blob: torch.Tensor, numel: int, moments_dtype: torch.dtype):
    """(master fp32, exp_avg, exp_avg_sq) views of a chunk's fp32 state blob."""
    moments = blob[numel:].view(moments_dtype).view(2, numel)
    return blob[:numel], moments[0], moments[1]


def _fused_op(adamw: bool):
    return getattr(torch, "_fused_adamw_" if adamw else "_fused_adam_", None)


@dataclass
class _Group:
    """Per param group: the split, the GPU-side state and the offloaded side's buffers."""

    index: int
    params: list[torch.Tensor]
    plan: GroupPlan
    steps: list[int]
    # GPU side, one entry per GPU piece
    gpu_views: list[torch.Tensor] = field(default_factory=list)
    gpu_masters: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg: list[torch.Tensor] = field(default_factory=list)
    gpu_exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    gpu_steps: list[torch.Tensor] = field(default_factory=list)
    # offloaded side
    grad_key: Any = None
    out_key: Any = None
    grad_buf: torch.Tensor | None = None
    out_buf: torch.Tensor | None = None
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
        state_tier: ``"cpu"`` (pinned host RAM) or ``"nvme"`` (streamed through the store).
        store: the TierStore to keep offloaded state in; ``None`` makes a private one sized for
            this optimizer (``state_tier="nvme"`` then needs ``nvme_dir``).
        nvme_dir: spill directory of the private store (with ``state_tier="nvme"``).
        overlap: step offloaded chunks during backward as their gradients land (else all at
            ``step()``).
        chunk_numel: elements per offloaded chunk (the unit of the CPU step and NVMe I/O).
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

    Raises:
        ValueError: a value out of range, an unknown ``state_tier``, NVMe without a spill
            directory, params on several devices or on another device than ``store``, or a
            store without room, each naming the field and the fix.
        TypeError: a param that is not a floating-point leaf tensor.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, adamw: bool = True,
                 maximize: bool = False, offload_fraction: float = 1.0, state_tier: str = "cpu",
                 store: TierStore | None = None, nvme_dir: str | None = None, overlap: bool = True,
                 chunk_numel: int = 1 << 22, max_grad_norm: float | None = None,
                 grad_accumulation_steps: int = 1, moments_dtype: torch.dtype = torch.float32,
                 cpu_threads: int | None = None,
                 nvme_lookahead_chunks: int = 2) -> None:
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
        if state_tier not in ("cpu", "nvme"):
            raise ValueError(f"HybridAdam: state_tier={state_tier!r} is unknown; use 'cpu' "
                             f"(pinned RAM) or 'nvme' (spill files)")
        if state_tier == "nvme" and store is None and not nvme_dir:
            raise ValueError("HybridAdam: state_tier='nvme' needs a spill directory: pass "
                             "nvme_dir='/path/on/ssd' or a store with StoreConfig.nvme_bytes > 0")
        if state_tier == "nvme" and store is not None and store.config.nvme_bytes == 0:
            raise ValueError("HybridAdam: state_tier='nvme' but the store has no nvme tier "
                             "(StoreConfig.nvme_bytes=0); give it nvme_bytes and nvme_dir")
        if not isinstance(chunk_numel, int) or chunk_numel < 1024:
            raise ValueError(f"HybridAdam: chunk_numel={chunk_numel!r} must be an int >= 1024")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"HybridAdam: max_grad_norm={max_grad_norm!r} must be > 0 or None")
        if not isinstance(grad_accumulation_steps, int) or grad_accumulation_steps < 1:
            raise ValueError(f"HybridAdam: grad_accumulation_steps={grad_accumulation_steps!r} "
                             f"must be an int >= 1")
        if moments_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"HybridAdam: moments_dtype={moments_dtype} is not supported; use "
                             f"torch.float32 or torch.bfloat16")
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
        if store is not None and store.device != self.device:
            raise ValueError(f"HybridAdam: params are on {self.device} but the store's device is "
                             f"{store.device}; make the store with StoreConfig.device="
                             f"{str(self.device)!r}")
        self.offload_fraction = float(offload_fraction)
        self.state_tier = state_tier
        self.overlap = overlap
        self.chunk_numel = chunk_numel
        self.max_grad_norm = max_grad_norm
        self.grad_accumulation_steps = grad_accumulation_steps
        self.moments_dtype = moments_dtype
        if cpu_threads is None and overlap and self.device.type == "cuda":
            cpu_threads = max(1, torch.get_num_threads() - 1)  # one core launches GPU work
        self.cpu_threads = cpu_threads
        self.nvme_lookahead_chunks = nvme_lookahead_chunks
        self._groups = [
            _Group(gi, list(g["params"]),
                   plan_group([p.numel() for p in g["params"]],
                              [p.element_size() for p in g["params"]], self.offload_fraction,
                              chunk_numel),
                   [0] * len(g["params"]))
            for gi, g in enumerate(self.param_groups)]
        self._owns_store = store is None
        self._store = store if store is not None else self._make_store(nvme_dir)
        self._copier = Copier(self.device)
        self._init_state()
        # cross-thread step state, guarded by _lock (hooks run on autograd threads)
        self._lock = threading.Lock()
        self._acc_count: dict[tuple[int, int], int] = {}
        self._shipped: set[tuple[int, int]] = set()
        self._grad_events: dict[tuple[int, int], list] = {}
        self._chunk_missing: dict[tuple[int, int], int] = {}
        self._queued: set[tuple[int, int]] = set()
        self._h2d_events: list = []
        self._errors: list[BaseException] = []
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._compute_allowed = threading.Event()
        self._clip_coef: torch.Tensor | None = None
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="tiermem-hybrid-adam", daemon=True)
        self._worker.start()
        self._hooks = [  # count backward passes always; ship early only with overlap
            g.params[i].register_post_accumulate_grad_hook(lambda p, g=g.index, i=i: self._on_grad(g, i))
            for g in self._groups for i in g.plan.chunks_of_param]
        self._begin_step()

    # ------------------------------------------------------------------ setup

    def _offloaded_numel(self) -> int:
        return sum(g.plan.cpu_numel for g in self._groups)

    def _make_store(self, nvme_dir: str | None) -> TierStore:
        n = self._offloaded_numel()
        buf_bytes = sum(round_up(g.plan.cpu_numel * g.params[0].element_size()) * 2
                        for g in self._groups if g.plan.cpu_numel)
        chunk_bytes = round_up(4 * _state_numel(self.chunk_numel, self.moments_dtype))
        state_bytes = sum(round_up(4 * _state_numel(c.numel, self.moments_dtype)) for g in self._groups
                          for c in g.plan.chunks)
        if self.state_tier == "cpu":
            cpu_bytes = buf_bytes + state_bytes
            nvme_bytes = 0
        else:
            cpu_bytes = buf_bytes + chunk_bytes * (self.nvme_lookahead_chunks + 3)
            # slack: chunk extents are freed on read and reallocated on write-back
            nvme_bytes = state_bytes + chunk_bytes * (self.nvme_lookahead_chunks + 3)
        # slabs hold a whole number of chunks; slack for the buffers' partial slabs
        slab_bytes = chunk_bytes * max(1, (1 << 30) // chunk_bytes)
        cpu_bytes += 2 * chunk_bytes
        return TierStore(StoreConfig(
            gpu_bytes=0, cpu_bytes=cpu_bytes, nvme_bytes=nvme_bytes,
            nvme_dir=nvme_dir if nvme_bytes else None, device=str(self.device),
            pool_slab_bytes=min(slab_bytes, cpu_bytes)))

    def _init_state(self) -> None:
        for g in self._groups:
            for piece in g.plan.gpu_pieces:
                p = g.params[piece.param]
                view = p.detach().view(-1)[piece.start:piece.start + piece.numel]
                g.gpu_views.append(view)
                g.gpu_masters.append(view if p.dtype == torch.float32 else view.float())
                g.gpu_exp_avg.append(torch.zeros(piece.numel, dtype=torch.float32, device=p.device))
                g.gpu_exp_avg_sq.append(torch.zeros(piece.numel, dtype=torch.float32, device=p.device))
                g.gpu_steps.append(torch.tensor(0.0, dtype=torch.float32, device=p.device))
            if not g.plan.cpu_numel:
                continue
            dtype = g.params[0].dtype
            if any(g.params[pc.param].dtype != dtype for pc in g.plan.cpu_pieces):
                raise ValueError(f"HybridAdam: param group {g.index} mixes dtypes; put params of "
                                 f"different dtypes in different param groups")
            g.grad_key = ("hybrid_adam", id(self), g.index, "grad")
            g.out_key = ("hybrid_adam", id(self), g.index, "out")
            for key in (g.grad_key, g.out_key):
                self._store.put(key, torch.empty(g.plan.cpu_numel, dtype=dtype), tier="cpu")
            g.grad_buf = self._store.get(g.grad_key, "cpu", hold=True)
            g.out_buf = self._store.get(g.out_key, "cpu", hold=True)
            flat_params = [g.params[i].detach().view(-1) for i in range(len(g.params))]
            for chunk in g.plan.chunks:
                state = torch.zeros(_state_numel(chunk.numel, self.moments_dtype))
                master = state[:chunk.numel]
                for pc in chunk.pieces:
                    lo = pc.flat_offset - chunk.flat_start
                    master[lo:lo + pc.numel].copy_(flat_params[pc.param][pc.start:pc.start + pc.numel])
                key = ("hybrid_adam", id(self), g.index, "chunk", chunk.index)
                self._store.put(key, state, tier=self.state_tier)
                g.chunk_keys.append(key)

    # ------------------------------------------------------------------ backward side

    def _on_grad(self, g: int, i: int) -> None:
        """Post-accumulate-grad hook of an offloaded param: ship its grad on the last micro-batch."""
        with self._lock:
            count = self._acc_count.get((g, i), 0) + 1
            self._acc_count[(g, i)] = count
            if not self.overlap or count < self.grad_accumulation_steps or (g, i) in self._shipped:
                return
        self._ship(g, i)

    def _ship(self, g: int, i: int) -> None:
        group = self._groups[g]
        p = group.params[i]
        events = []
        if p.grad is not None:
            flat_grad = p.grad.detach().view(-1)
            for c in dict.fromkeys(group.plan.chunks_of_param[i]):
                for pc in group.plan.chunks[c].pieces:
                    if pc.param == i:
                        events.append(self._copier.d2h(
                            group.grad_buf[pc.flat_offset:pc.flat_offset + pc.numel],
                            flat_grad[pc.start:pc.start + pc.numel]))
        ready = []
        with self._lock:
            self._shipped.add((g, i))
            self._grad_events[(g, i)] = [e for e in events if e is not None] if p.grad is not None else None
            for c in dict.fromkeys(group.plan.chunks_of_param[i]):
                self._chunk_missing[(g, c)] -= 1
                if self._chunk_missing[(g, c)] == 0:
                    ready.append((g, c))
        for item in ready:
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
            self._grad_events.clear()
            self._queued.clear()
            self._h2d_events = []
            self._chunk_missing = {
                (g.index, c): len({pc.param for pc in chunk.pieces})
                for g in self._groups for c, chunk in enumerate(g.plan.chunks)}
        self._clip_coef = None
        if self.max_grad_norm is None:
            self._compute_allowed.set()
        else:
            self._compute_allowed.clear()  # the CPU step needs the global norm first
        if self.state_tier == "nvme":
            for g, c in self._expected_order()[:self.nvme_lookahead_chunks]:
                self._store.prefetch(self._groups[g].chunk_keys[c], "cpu")

    def _expected_order(self) -> list[tuple[int, int]]:
        """Chunks in the order their gradients complete (reverse layer order with overlap)."""
        order = [(g.index, c) for g in self._groups for c in range(len(g.plan.chunks))]
        return order[::-1] if self.overlap else order

    # ------------------------------------------------------------------ the CPU worker

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._step_chunk(*item)
            except BaseException as exc:  # surfaced by step()
                with self._lock:
                    self._errors.append(exc)
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def _step_chunk(self, g: int, c: int) -> None:
        group = self._groups[g]
        chunk: Chunk = group.plan.chunks[c]
        with self._lock:
            events = {pc.param: self._grad_events.get((g, pc.param)) for pc in chunk.pieces}
        for evs in events.values():
            for event in evs or ():
                event.synchronize()  # the CPU reads the gradient bytes of this D2H copy
        self._compute_allowed.wait()  # with clipping: step() has set the clip coefficient
        key = group.chunk_keys[c]
        blob = self._store.get(key, "cpu", hold=True)
        try:
            master, exp_avg, exp_avg_sq = _state_views(blob, chunk.numel, self.moments_dtype)
            self._prefetch_after(g, c)
            lo, hi = chunk.flat_start, chunk.flat_start + chunk.numel
            grad, out = group.grad_buf[lo:hi], group.out_buf[lo:hi]
            hp = self.param_groups[g]
            beta1, beta2 = hp["betas"]
            runs = self._runs(group, chunk, events)
            if self._clip_coef is not None:
                for start, numel, _ in runs:
                    grad[start:start + numel].mul_(self._clip_coef)
            for start, numel, step in runs:
                adam_step_(master, grad, exp_avg, exp_avg_sq, step=step, lr=float(hp["lr"]),
                           beta1=beta1, beta2=beta2, eps=hp["eps"],
                           weight_decay=hp["weight_decay"], adamw=hp["adamw"],
                           maximize=hp["maximize"], param_out=out, offset=start, numel=numel,
                           num_threads=self.cpu_threads)
            last = None
            for pc in chunk.pieces:
                if events[pc.param] is None:
                    continue  # no gradient this step: param and state untouched, like torch
                rel = pc.flat_offset - lo
                dst = group.params[pc.param].detach().view(-1)[pc.start:pc.start + pc.numel]
                last = self._copier.h2d(dst, out[rel:rel + pc.numel]) or last
        finally:
            self._store.release(key)
        if self.state_tier == "nvme":
            self._store.evict(key, "nvme")  # write-back overlaps the next chunk's compute
        if last is not None:
            with self._lock:
                self._h2d_events.append(last)

    def _runs(self, group: _Group, chunk: Chunk, events: dict) -> list[tuple[int, int, int]]:
        """(start in chunk, numel, step) runs of consecutive pieces that have gradients."""
        runs: list[list[int]] = []
        for pc in chunk.pieces:
            if events[pc.param] is None:
                continue
            step = group.steps[pc.param] + 1
            start = pc.flat_offset - chunk.flat_start
            if runs and runs[-1][2] == step and runs[-1][0] + runs[-1][1] == start:
                runs[-1][1] += pc.numel
            else:
                runs.append([start, pc.numel, step])
        return [tuple(r) for r in runs]

    def _prefetch_after(self, g: int, c: int) -> None:
        if self.state_tier != "nvme":
            return
        order = self._expected_order()
        pos = order.index((g, c))
        for gg, cc in order[pos + 1:pos + 1 + self.nvme_lookahead_chunks]:
            self._store.prefetch(self._groups[gg].chunk_keys[cc], "cpu")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimizer step (see the module docstring for what overlaps).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Raises:
            RuntimeError: the CPU step failed (the worker's error is chained).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._lock:
            extra = [k for k, n in self._acc_count.items() if n > self.grad_accumulation_steps]
        if extra:
            raise RuntimeError(
                f"HybridAdam: {self._acc_count[extra[0]]} backward passes accumulated into a "
                f"parameter before step(), but grad_accumulation_steps="
                f"{self.grad_accumulation_steps}: gradients were copied off the GPU after pass "
                f"{self.grad_accumulation_steps}; set grad_accumulation_steps to the number of "
                f"backward passes per step")
        for g in self._groups:
            for i in g.plan.chunks_of_param:
                if (g.index, i) not in self._shipped:
                    self._ship(g.index, i)  # not shipped by a hook (no overlap / no grad / early step)
        if self.max_grad_norm is not None:
            consumer = self._copier.consumer_stream()
            if consumer is not None:
                consumer.wait_stream(self._copier.d2h_stream)  # D2H reads grads before clipping scales them
            self._clip_coef = self._clip(self.max_grad_norm)
        self._compute_allowed.set()
        for g in self._groups:
            self._step_gpu_side(g)
        with self._idle:
            while self._outstanding:
                self._idle.wait()  # the CPU step of every offloaded chunk has to finish
            errors, self._errors = self._errors, []
            events = self._h2d_events
        if errors:
            raise RuntimeError(f"HybridAdam: the CPU step failed: {errors[0]}") from errors[0]
        consumer = self._copier.consumer_stream()
        for event in events if consumer is not None else ():
            consumer.wait_event(event)  # the next forward reads the parameters copied H2D
        for g in self._groups:
            for i, p in enumerate(g.params):
                if p.grad is not None:
                    g.steps[i] += 1
        self._begin_step()
        return loss

    def _step_gpu_side(self, g: _Group) -> None:
        hp = self.param_groups[g.index]
        idx = [k for k, pc in enumerate(g.plan.gpu_pieces) if g.params[pc.param].grad is not None]
        if not idx:
            return
        grads = []
        for k in idx:
            pc = g.plan.gpu_pieces[k]
            grad = g.params[pc.param].grad.detach().view(-1)[pc.start:pc.start + pc.numel]
            grads.append(grad if grad.dtype == torch.float32 else grad.float())
        masters = [g.gpu_masters[k] for k in idx]
        steps = [g.gpu_steps[k] for k in idx]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = hp["betas"]
        fused = _fused_op(hp["adamw"])
        if fused is None:
            raise RuntimeError("HybridAdam needs torch._fused_adamw_ (torch >= 2.4)")
        fused(masters, grads, [g.gpu_exp_avg[k] for k in idx], [g.gpu_exp_avg_sq[k] for k in idx],
              [], steps, lr=hp["lr"], beta1=beta1, beta2=beta2, weight_decay=hp["weight_decay"],
              eps=hp["eps"], amsgrad=False, maximize=hp["maximize"], grad_scale=None,
              found_inf=None)
        for k in idx:
            if g.gpu_views[k] is not g.gpu_masters[k]:
                g.gpu_views[k].copy_(g.gpu_masters[k])

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip all grads to ``max_norm`` like ``torch.nn.utils.clip_grad_norm_`` and return the
        coefficient to apply to gradients already copied off the GPU (host tensor)."""
        params = [p for g in self._groups for p in g.params if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, 2.0) if hasattr(torch.nn.utils, "get_total_norm") \
            else torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return coef.cpu()

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
        """Full-size per-param state on the CPU: step, exp_avg, exp_avg_sq (+ master)."""
        out = []
        for g in self._groups:
            states = []
            for i, p in enumerate(g.params):
                st = {"step": torch.tensor(float(g.steps[i])),
                      "exp_avg": torch.zeros(p.shape, dtype=torch.float32),
                      "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32)}
                if p.dtype != torch.float32:
                    st["master"] = p.detach().float().cpu()
                states.append(st)
            for k, pc in enumerate(g.plan.gpu_pieces):
                st = states[pc.param]
                sl = slice(pc.start, pc.start + pc.numel)
                st["exp_avg"].view(-1)[sl] = g.gpu_exp_avg[k].cpu()
                st["exp_avg_sq"].view(-1)[sl] = g.gpu_exp_avg_sq[k].cpu()
                if "master" in st:
                    st["master"].view(-1)[sl] = g.gpu_masters[k].cpu()
            for chunk, key in zip(g.plan.chunks, g.chunk_keys):
                with self._chunk_state(key) as blob:
                    state = _state_views(blob, chunk.numel, self.moments_dtype)
                    for pc in chunk.pieces:
                        st = states[pc.param]
                        rel = pc.flat_offset - chunk.flat_start
                        sl = slice(pc.start, pc.start + pc.numel)
                        st["exp_avg"].view(-1)[sl] = state[1][rel:rel + pc.numel]
                        st["exp_avg_sq"].view(-1)[sl] = state[2][rel:rel + pc.numel]
                        if "master" in st:
                            st["master"].view(-1)[sl] = state[0][rel:rel + pc.numel]
            out.append(states)
        return out

    def _chunk_state(self, key):
        store, tier = self._store, self.state_tier

        class _Use:
            def __enter__(self_inner):
                self_inner.t = store.get(key, "cpu", hold=True)
                return self_inner.t

            def __exit__(self_inner, *exc):
                store.release(key)
                if tier == "nvme":
                    store.evict(key, "nvme").wait()
        return _Use()

    def state_dict(self) -> dict:
        """Return the state in torch.optim's format (``exp_avg``/``exp_avg_sq``/``step`` per
        param, plus ``master`` for non-fp32 params), gathered from GPU, RAM and NVMe."""
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

        Raises:
            ValueError: the number of groups or params, or a tensor's shape, does not match.
        """
        self._drain()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"HybridAdam.load_state_dict: the state has {len(groups)} param "
                             f"groups but this optimizer has {len(self.param_groups)}")
        for gi, (saved, g) in enumerate(zip(groups, self._groups)):
            if len(saved["params"]) != len(g.params):
                raise ValueError(f"HybridAdam.load_state_dict: param group {gi} has "
                                 f"{len(saved['params'])} params in the state but "
                                 f"{len(g.params)} here")
            for sid, p in zip(saved["params"], g.params):
                st = state_dict["state"].get(sid)
                if st is None:
                    continue
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if name in st and tuple(st[name].shape) != tuple(p.shape):
                        raise ValueError(f"HybridAdam.load_state_dict: {name} of param {sid} "
                                         f"has shape {tuple(st[name].shape)} but the param has "
                                         f"{tuple(p.shape)}; the state is for another model")
        for saved, hp in zip(groups, self.param_groups):
            hp.update({k: v for k, v in saved.items() if k != "params"})
        for saved, g in zip(groups, self._groups):
            sts = [state_dict["state"].get(sid) for sid in saved["params"]]
            self._scatter(g, sts)

    def _scatter(self, g: _Group, sts: list[dict | None]) -> None:
        def master_of(i):
            st = sts[i]
            if st is not None and "master" in st:
                return st["master"].float().reshape(-1)
            return g.params[i].detach().float().reshape(-1).cpu()

        for i, st in enumerate(sts):
            g.steps[i] = int(float(st["step"])) if st is not None else 0
        for k, pc in enumerate(g.plan.gpu_pieces):
            st = sts[pc.param]
            sl = slice(pc.start, pc.start + pc.numel)
            zero = torch.zeros(pc.numel)
            g.gpu_exp_avg[k].copy_(st["exp_avg"].reshape(-1)[sl] if st else zero)
            g.gpu_exp_avg_sq[k].copy_(st["exp_avg_sq"].reshape(-1)[sl] if st else zero)
            g.gpu_steps[k].fill_(float(g.steps[pc.param]))
            if g.gpu_masters[k] is not g.gpu_views[k]:
                g.gpu_masters[k].copy_(master_of(pc.param)[sl])
        for chunk, key in zip(g.plan.chunks, g.chunk_keys):
            with self._chunk_state(key) as blob:
                state = _state_views(blob, chunk.numel, self.moments_dtype)
                for pc in chunk.pieces:
                    st = sts[pc.param]
                    rel = pc.flat_offset - chunk.flat_start
                    sl = slice(pc.start, pc.start + pc.numel)
                    state[0][rel:rel + pc.numel] = master_of(pc.param)[sl]
                    for row, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
                        state[row][rel:rel + pc.numel] = st[name].reshape(-1)[sl] if st else 0

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

    def memory_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes per place: ``{"gpu": ..., "cpu": ..., "nvme": ...}``."""
        gpu = sum(t.numel() * 4 for g in self._groups
                  for t in g.gpu_exp_avg + g.gpu_exp_avg_sq) + sum(
            m.numel() * 4 for g in self._groups for m, v in zip(g.gpu_masters, g.gpu_views)
            if m is not v)
        s = self._store.stats()
        return {"gpu": gpu, "cpu": s["cpu"]["used_bytes"], "nvme": s["nvme"]["used_bytes"]}

    def close(self) -> None:
        """Stop the worker, remove hooks and free the private store. Idempotent."""
        if self._worker.is_alive():
            self._queue.put(None)
            self._worker.join()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._owns_store:
            self._store.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to free
            pass
