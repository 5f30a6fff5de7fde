"""HybridAdam's state in torch.optim's format: gathered per param from the GPU side, RAM and
NVMe (and, data parallel, from every rank's shard), and scattered back into them.

Saved moments are fp32 whatever ``moments_dtype`` is (bf16 moments widen exactly, from the GPU
side and the offloaded chunks alike); loading rounds them to ``moments_dtype`` (to nearest even,
so bf16 moments round-trip bit for bit).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from tiermem.optim import distributed as _dist
from tiermem.optim.layout import Group, StateLayout, local_view, param_index, state_views


def offloaded_pieces(layout: StateLayout, g: Group) -> Iterator[tuple]:
    """Yield ``(piece, slice of the local tensor, (master, exp_avg, exp_avg_sq) views of the
    piece's state)`` for every offloaded piece of ``g``, chunk by chunk; a chunk's state is
    held in RAM while its pieces are visited and written back to NVMe after.

    Raises:
        StoreClosedError: the store was closed.
    """
    store = layout.store
    for chunk, key in zip(g.plan.chunks, g.chunk_keys):
        blob = store.get(key, "cpu", hold=True)
        try:
            views = state_views(blob, chunk.numel, layout.moments_dtype)
            for pc in chunk.pieces:
                rel = pc.flat_offset - chunk.flat_start
                yield (pc, slice(pc.start, pc.start + pc.numel),
                       tuple(v[rel:rel + pc.numel] for v in views))
        finally:
            store.release(key)
        if (g.index, chunk.index) in layout.nvme_chunks:
            store.evict(key, "nvme").wait()


def param_states(layout: StateLayout, mode: str, zero: Any,
                 device: torch.device) -> list[list[dict]]:
    """Per-param state in torch's format: step, exp_avg, exp_avg_sq (+ master).

    One process (``mode="local"``): full-size CPU tensors. FSDP2 (``"fsdp"``): DTensors like
    the params (local shard on the CPU). Data parallel (``"zero"``, ``zero`` its ZeroComm):
    full-size CPU tensors on every rank (collective, staged through ``device``).

    Raises:
        StoreClosedError: the store was closed.
    """
    local = local_states(layout)
    if mode == "zero":
        return _gather_states(layout, local, zero, device)
    out = []
    for g, states in zip(layout.groups, local):
        group_out = []
        for i, st in enumerate(states):
            p = g.params[i]
            shape = _dist.local_of(p).shape
            full = {"step": torch.tensor(float(st["step"]))}
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if name in st:
                    t = st[name].view(shape)
                    full[name] = _dist.to_dtensor(t, p) if mode == "fsdp" else t
            group_out.append(full)
        out.append(group_out)
    return out


def _gather_states(layout: StateLayout, local: list[list[dict]], zero: Any,
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


def local_states(layout: StateLayout) -> list[list[dict]]:
    """Per local tensor: flat fp32 CPU ``exp_avg``, ``exp_avg_sq`` (bf16 moments widened) (+
    ``master`` for non-fp32 params) and the int ``step``, gathered from GPU, RAM and NVMe.

    Raises:
        StoreClosedError: the store was closed.
    """
    out = []
    for g in layout.groups:
        states = []
        for i in range(g.n_local):
            local = local_view(g, i)
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
        for pc, sl, (master, exp_avg, exp_avg_sq) in offloaded_pieces(layout, g):
            st = states[pc.param]
            st["exp_avg"].view(-1)[sl] = exp_avg
            st["exp_avg_sq"].view(-1)[sl] = exp_avg_sq
            if "master" in st:
                st["master"].view(-1)[sl] = master
        out.append(states)
    return out


def scatter(layout: StateLayout, g: Group, param_sts: list[dict | None], mode: str,
            who: str) -> None:
    """Load group ``g``'s saved per-param states ``param_sts`` (None: no state, the moments
    start at zero) into the GPU side, RAM and NVMe (moments rounded to ``moments_dtype``);
    ``mode`` as in :func:`param_states`, ``who`` the error prefix.

    Raises:
        ValueError: an FSDP2 DTensor that cannot be redistributed to the param's placements.
        StoreClosedError: the store was closed.
    """
    sts = [param_sts[param_index(g, i)] for i in range(g.n_local)]

    def local_src(i: int, name: str) -> torch.Tensor:
        """This rank's part of saved tensor ``name`` of local tensor ``i``, flat."""
        t = sts[i][name]
        p = g.params[param_index(g, i)]
        if mode == "fsdp":
            return _dist.local_state(t, p, name, who).reshape(-1)
        if g.segments is not None:
            seg = g.segments[i]
            return t.reshape(-1)[seg.start:seg.start + seg.numel]
        return t.reshape(-1)

    def master_of(i):
        st = sts[i]
        if st is not None and "master" in st:
            return local_src(i, "master").float()
        return local_view(g, i).float().cpu()

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
    for pc, sl, (master, exp_avg, exp_avg_sq) in offloaded_pieces(layout, g):
        master.copy_(master_of(pc.param)[sl])
        for moment, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            if sts[pc.param]:
                moment.copy_(local_src(pc.param, name)[sl])
            else:
                moment.zero_()
