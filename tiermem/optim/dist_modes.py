"""HybridAdam's distributed modes: ZeRO-1/2 data parallel (:class:`ZeroMode`) and FSDP2 local
shards (:class:`FsdpMode`); the design is in :mod:`tiermem.optim.distributed`, the interface in
:class:`tiermem.optim.modes.Mode`. Imported only by
:func:`tiermem.optim.hybrid_adam.choose_mode`, for a distributed run.

HybridAdam on several ranks (torch.distributed):
- ``data_parallel=True`` (or ``process_group=pg``), plain replicated params, no DDP wrapper:
  ZeRO-1/2. Each rank owns ``1/world`` of every param group's flattened elements and keeps
  optimizer state only for them (split GPU / offloaded by ``offload_fraction`` within the
  shard); gradients are reduced to their owner in buckets from the grad hooks (average, like
  DDP), the owner steps its shard, and the updated shards are all-gathered in ``step()``.
- FSDP2 (params are DTensors after ``fully_shard``): every rank steps its local shard, FSDP does
  the communication; ``max_grad_norm`` all-reduces the squared norm; ``state_dict()`` returns
  DTensors for ``torch.distributed.checkpoint``.
Spill directories are per rank (``nvme_dir/rank{r}``) and errors name the rank.

Note [reduced gradients untouched]: with ZeRO and ``overlap=True`` a param's post-accumulate-grad
hook copies ``p.grad`` into its reduce bucket during backward, and the rank steps its shard from
the reduced bucket, never from ``p.grad``. A change to ``p.grad`` after backward
(``torch.nn.utils.clip_grad_norm_``; ``torch.amp.GradScaler``, which unscales ``p.grad`` in
place here since ZeRO does not take the scale itself; a write through ``p.grad.data``) reached
nothing and was silently ignored: a world-1 gloo run stepped the unclipped (or still scaled)
gradients, 0.006 (clip) and 0.012 (scaler) from torch's AdamW after 4 steps; one process
refuses it (Note [gradient checksums] in grad_sums.py), data parallel did not. Now the hook
takes the gradient's :func:`~tiermem.optim.grad_sums.shipped_mark` (version, pointer,
checksum on the hook's stream) and ``step()`` compares it on every rank before it ships the
buckets; whether some rank saw a change rides on the has-a-gradient flags' all-reduce
(``ZeroComm.flush``), so every rank refuses together (no collective left waiting), after the
caller's stream waits for the buckets' reduces. Chunks stepped during backward stay stepped
(the message says to restart from a checkpoint). Cost: a checksum kernel per gradient at its
hook and in ``step()``, and one host read of them per step. ``overlap=False`` fills the
buckets in ``step()`` from ``p.grad`` as it is then: nothing to compare.
tests/optim/test_worker_windows.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from tiermem.optim import distributed as _dist
from tiermem.optim.grad_sums import changed_since_ship, shipped_mark
from tiermem.optim.hyperparams import check_dense_grad
from tiermem.optim.layout import Group, StateLayout, local_view
from tiermem.optim.modes import Mode, grad_hook
from tiermem.optim.state_dict import local_states, param_states


def choose(params: list[torch.Tensor], dp: bool, process_group: Any, bucket_numel: int) -> Mode:
    """:class:`FsdpMode` for DTensor params, else :class:`ZeroMode` (``dp`` is asked).

    Raises:
        ValueError: DTensors with ``data_parallel``/``process_group``, a mix of DTensors and
            plain params, or ``data_parallel`` without an initialized torch.distributed.
    """
    if any(_dist.is_dtensor(p) for p in params):
        who = _dist.rank_prefix()
        if dp:
            raise ValueError(f"{who}: the params are DTensors (FSDP2 fully_shard), which FSDP "
                             f"already shards and reduces; drop data_parallel=True / "
                             f"process_group: HybridAdam steps each rank's local shard")
        _dist.check_fsdp_params(params, who)
        return FsdpMode(who, params)
    if not _dist.dist_ready():
        raise ValueError("HybridAdam: data_parallel=True needs torch.distributed: call "
                         "torch.distributed.init_process_group(...) on every rank before "
                         "building the optimizer (or leave data_parallel off)")
    return ZeroMode(_dist.rank_prefix(), process_group, bucket_numel)


class _DistMode(Mode):
    """What both distributed modes share: per-rank spill directories and a clipping norm
    all-reduced over ``norm_groups``."""

    one_process = False
    norm_groups: list = []

    def spill_dir(self, nvme_dir: str | None) -> str | None:
        return _dist.rank_dir(nvme_dir)  # ranks on one host never share spill files

    def grads_and_norm(self, groups: list[Group], device: torch.device
                       ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The squared norm of this rank's (shard) gradients is all-reduced over the
        data-parallel group, or over the mesh dimensions FSDP2 shards on, so every rank clips
        by the norm of the whole averaged gradient."""
        grads = [self.grad_of(g, i) for g in groups for i in range(g.n_local)
                 if self.has_grad(g, i)]
        grads = [t for t in grads if t.numel()]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            sq = torch.stack([n.float() for n in norms]).square().sum()
        for group in self.norm_groups:
            torch.distributed.all_reduce(sq, group=group)
        return grads, sq.sqrt()


class FsdpMode(_DistMode):
    """FSDP2: each rank steps its params' local shards; FSDP reduces and gathers. FSDP2
    assigns the sharded ``.grad`` itself: no hook fires, everything ships in ``step()``."""

    name = "fsdp"

    def __init__(self, who: str, params: list[torch.Tensor]) -> None:
        super().__init__(who)
        self.norm_groups = _dist.shard_groups(params[0].device_mesh, tuple(params[0].placements))

    def ship_rest(self, opt: Any, ship: Callable[[], None]) -> None:
        opt._layout.refresh_views()
        ship()

    def refresh_views(self, layout: StateLayout) -> None:
        layout.refresh_views()

    def param_states(self, layout: StateLayout, device: torch.device) -> list[list[dict]]:
        return param_states(layout, _dist.to_dtensor)

    def local_state(self, t: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
        return _dist.local_state(t, param, name, self.who).reshape(-1)


class ZeroMode(_DistMode):
    """ZeRO-1/2: this rank steps its shard's pieces of the params (``segments``); gradients
    are reduced to their owner in buckets from the hooks, the updated shards all-gathered."""

    name = "zero"

    def __init__(self, who: str, process_group: Any, bucket_numel: int) -> None:
        super().__init__(who)
        self._process_group = process_group
        self._bucket_numel = bucket_numel
        self.zero: _dist.ZeroComm | None = None
        self._marks: dict = {}  # (group, param) -> its gradient's Mark at the hook

    def attach(self, param_groups: list[dict], device: torch.device) -> None:
        self.zero = _dist.ZeroComm([list(g["params"]) for g in param_groups],
                                   self._process_group, self._bucket_numel, device, self.who)
        self.norm_groups = [self.zero.pg]

    def local_shapes(self, gi: int, params: list[torch.Tensor]
                     ) -> tuple[list[int], list[int], list | None]:
        segments = self.zero.groups[gi].segments
        return ([s.numel for s in segments], [params[s.param].element_size() for s in segments],
                segments)

    def buckets_of(self, gi: int) -> dict[int, list[int]]:
        bucket_of, out = self.zero.groups[gi].bucket_of, {}
        for li, seg in enumerate(self.zero.groups[gi].segments):
            out.setdefault(bucket_of[seg.param], []).append(li)
        return out

    def grad_hooks(self, ref: weakref.ref, groups: list[Group], trace: bool) -> list:
        return [  # every gradient goes into a reduce bucket
            p.register_post_accumulate_grad_hook(functools.partial(grad_hook, ref, g.index, i))
            for g in groups for i, p in enumerate(g.params) if p.requires_grad]

    def on_grad(self, opt: Any, g: int, i: int) -> None:
        """On the last micro-batch, put param ``i``'s gradient in its reduce bucket; ship the
        shard pieces of the buckets that were reduced."""
        check_dense_grad(opt._who, g, i, opt._groups[g].params[i])
        opt._step.note_backward(opt.param_groups)  # Note [late hyper-parameters]
        with opt._step.lock:
            count = opt._step.acc_count.get((g, i), 0) + 1
            opt._step.acc_count[(g, i)] = count
            if not opt.overlap or count < opt.grad_accumulation_steps:
                return
        grad = opt._groups[g].params[i].grad
        if grad is not None:  # Note [reduced gradients untouched]: step() compares it
            self._marks[(g, i)] = shipped_mark(grad, None, opt._step)
        launched = self.zero.grad_arrived(g, i, grad)
        self._ship_buckets(opt, launched)

    def _ship_buckets(self, opt: Any, launched: list[tuple[int, int]]) -> None:
        """Ship this rank's offloaded pieces of the reduced buckets ``launched`` (D2H from the
        communication stream, so after the reduce)."""
        if not launched:
            return
        with self.zero.on_stream():
            for g, b in launched:
                group = opt._groups[g]
                for li in group.locals_in_bucket.get(b, ()):
                    if li in group.plan.chunks_of_param and (g, li) not in opt._step.shipped:
                        opt._ship(g, li)

    def begin_step(self) -> None:
        self._marks = {}
        if self.zero is not None:
            self.zero.begin_step()

    def _changed(self, opt: Any) -> bool:
        """Whether a gradient copied into its bucket during backward changed since (this
        rank; Note [reduced gradients untouched]): replaced, another version, or other bytes."""
        marks = self._marks
        grads = {k: opt._groups[k[0]].params[k[1]].grad for k in marks}
        moved = [k for k, (version, ptr, _) in marks.items() if grads[k] is None
                 or grads[k]._version != version or grads[k].data_ptr() != ptr]
        return bool(moved) or bool(changed_since_ship(marks, grads))

    def grad_of(self, g: Group, i: int) -> torch.Tensor | None:
        s = g.segments[i]
        if self.zero.flags is not None and not self.zero.has_grad(g.index, s.param):
            return None
        return self.zero.shard_grad(g.index, i)

    def has_grad(self, g: Group, i: int) -> bool:
        return self.zero.has_grad(g.index, g.segments[i].param)

    def ship_rest(self, opt: Any, ship: Callable[[], None]) -> None:
        # buckets not reduced in backward, then the has-grad flags
        launched = self.zero.flush(lambda g, i: opt._groups[g].params[i].grad,
                                   changed=self._changed(opt))
        if self.zero.changed_any:  # Note [reduced gradients untouched]: on every rank
            self.zero.join_stream()  # the next backward refills the buckets these reduce
            opt._step.abandon()  # chunks not yet stepped are not
            opt._begin_step()
            raise RuntimeError(
                f"{self.who}: a gradient was changed after backward had already copied it into "
                f"its data-parallel reduce bucket (overlap=True) on some rank, e.g. by "
                f"torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler (which unscales p.grad "
                f"after backward) or a write through p.grad.data: the step would use the "
                f"unchanged gradients. Clip with HybridAdam(max_grad_norm=...), or build "
                f"HybridAdam with overlap=False (gradients are reduced in step(), after a "
                f"scaler's unscale), or train bf16 without a scaler. This step was not applied "
                f"consistently: restart from a checkpoint")
        self._ship_buckets(opt, launched)
        with self.zero.on_stream():
            ship()
        self.zero.join_stream()  # the GPU side and clipping read the reduced gradients

    def other_rank_failed(self, failed: bool) -> bool:
        return self.zero.any_failed(failed)

    def gather_params(self, groups: list[Group]) -> None:
        # every rank gets every rank's updated shard
        self.zero.gather(lambda g: ([local_view(groups[g], i) for i in range(groups[g].n_local)],
                                    groups[g].params))

    def param_states(self, layout: StateLayout, device: torch.device) -> list[list[dict]]:
        return _gather_states(layout, local_states(layout), self.zero, device)


def _gather_states(layout: StateLayout, local: list[list[dict]], zero: _dist.ZeroComm,
                   device: torch.device) -> list[list[dict]]:
    """Data parallel: assemble every param's full state from the ranks' shards (an
    all-reduce of disjoint pieces, staged through bounded buffers on the params' device)."""
    out = []
    for g, states in zip(layout.groups, local):
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
                piece = full[name][lo:lo + stage].to(device)
                torch.distributed.all_reduce(piece, group=zero.pg)
                full[name][lo:lo + stage] = piece.cpu()
        steps = torch.zeros(len(g.params), dtype=torch.int64)
        for seg, st in zip(zg.segments, states):
            steps[seg.param] = max(int(steps[seg.param]), st["step"])
        steps = steps.to(device)
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
