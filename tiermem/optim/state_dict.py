"""HybridAdam's state in torch.optim's format: gathered per param from the GPU side, RAM and
NVMe, and scattered back into them (data parallel gathers every rank's shard in
:mod:`tiermem.optim.dist_modes`).

Saved moments are fp32 whatever ``moments_dtype`` is (bf16 moments widen exactly, from the GPU
side and the offloaded chunks alike); loading rounds them to ``moments_dtype`` (to nearest even,
so bf16 moments round-trip bit for bit).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from tiermem.optim.hyperparams import check_group
from tiermem.optim.layout import Group, StateLayout, local_view, param_index, state_views
from tiermem.optim.local_tensor import local_of
from tiermem.store.spill_errors import SpillError


def offloaded_pieces(layout: StateLayout, g: Group, overwrite: bool = False) -> Iterator[tuple]:
    """Yield ``(piece, slice of the local tensor, (master, exp_avg, exp_avg_sq) views of the
    piece's state)`` for every offloaded piece of ``g``, chunk by chunk; a chunk's state is
    held in RAM while its pieces are visited and written back to NVMe after.

    ``overwrite``: the caller writes every piece's state (a load), so a chunk whose NVMe copy
    cannot be read (a truncated or corrupted spill file, Note [failed steps] in step_tail.py)
    is replaced by a fresh blob instead of failing the load.

    Raises:
        StoreClosedError: the store was closed.
        SpillError: (not ``overwrite``) a chunk's state could not be read back, naming it.
    """
    store = layout.store
    for chunk, key in zip(g.plan.chunks, g.chunk_keys):
        try:
            blob = store.get(key, "cpu", hold=True)
        except SpillError:
            if not overwrite:
                raise
            store.put(key, layout.initial_state(g, chunk), tier="cpu")  # every byte rewritten
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


def param_states(layout: StateLayout,
                 wrap: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                 ) -> list[list[dict]]:
    """Per-param state in torch's format: step, exp_avg, exp_avg_sq (+ master), shaped like
    each param's local tensor (one process: full-size CPU tensors). ``wrap(t, param)`` turns
    each state tensor into what the caller returns (FSDP2: a DTensor like the param, see
    ``FsdpMode`` in :mod:`tiermem.optim.dist_modes`); data parallel gathers its own.

    Raises:
        StoreClosedError: the store was closed.
    """
    out = []
    for g, states in zip(layout.groups, local_states(layout)):
        group_out = []
        for i, st in enumerate(states):
            p = g.params[i]
            shape = param_shape(g, i, local_of(p))
            full = {"step": torch.tensor(float(st["step"]))}
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if name in st:
                    t = st[name].view(shape)
                    full[name] = wrap(t, p) if wrap is not None else t
            group_out.append(full)
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


def scatter(layout: StateLayout, g: Group, param_sts: list[dict | None],
            cut: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]) -> None:
    """Load group ``g``'s saved per-param states ``param_sts`` (None: no state, the moments
    start at zero) into the GPU side, RAM and NVMe (moments rounded to ``moments_dtype``);
    ``cut(t, param, name)`` is this rank's part of a saved whole-param tensor, flat (the
    mode's ``local_state``: one process the tensor itself; data parallel cuts by segment here).

    Raises:
        ValueError: an FSDP2 DTensor that cannot be redistributed to the param's placements.
        StoreClosedError: the store was closed.
    """
    sts = [param_sts[param_index(g, i)] for i in range(g.n_local)]

    def local_src(i: int, name: str) -> torch.Tensor:
        """This rank's part of saved tensor ``name`` of local tensor ``i``, flat."""
        t = sts[i][name]
        p = g.params[param_index(g, i)]
        if g.segments is not None:
            seg = g.segments[i]
            return t.reshape(-1)[seg.start:seg.start + seg.numel]
        return cut(t, p, name)

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
    for pc, sl, (master, exp_avg, exp_avg_sq) in offloaded_pieces(layout, g, overwrite=True):
        master.copy_(master_of(pc.param)[sl])
        for moment, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            if sts[pc.param]:
                moment.copy_(local_src(pc.param, name)[sl])
            else:
                moment.zero_()


def check_loadable(state_dict: dict, layout_groups: list[Group], who: str) -> None:
    """Refuse a state that does not fit the optimizer's groups before anything is loaded.

    Raises:
        ValueError: a bad or amsgrad hyper-parameter group, another number of groups or
            params, or a tensor whose shape is not its param's.
    """
    groups = state_dict["param_groups"]
    for gi, saved in enumerate(groups):  # Note [finite hyper-parameters]: no amsgrad
        check_group(f"{who}.load_state_dict", gi, saved)
        if any("max_exp_avg_sq" in (state_dict["state"].get(sid) or {})
               for sid in saved["params"]):
            raise ValueError(f"{who}.load_state_dict: param group {gi} holds an "
                             f"amsgrad state (max_exp_avg_sq); HybridAdam does not "
                             f"implement amsgrad: continue it with torch.optim.AdamW("
                             f"amsgrad=True)")
    if len(groups) != len(layout_groups):
        raise ValueError(f"{who}.load_state_dict: the state has {len(groups)} param "
                         f"groups but this optimizer has {len(layout_groups)}")
    for gi, (saved, g) in enumerate(zip(groups, layout_groups)):
        if len(saved["params"]) != len(g.params):
            raise ValueError(f"{who}.load_state_dict: param group {gi} has "
                             f"{len(saved['params'])} params in the state but "
                             f"{len(g.params)} here")
        for k, (sid, p) in enumerate(zip(saved["params"], g.params)):
            st = state_dict["state"].get(sid)
            if st is None:
                continue
            shape = tuple(param_shape(g, k, p))
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if name in st and tuple(st[name].shape) != shape:
                    raise ValueError(f"{who}.load_state_dict: {name} of param {sid} "
                                     f"has shape {tuple(st[name].shape)} but the param has "
                                     f"{shape}; the state is for another model")


def param_shape(g: Group, i: int, t: torch.Tensor) -> torch.Size:
    """The shape of param ``i`` of ``g`` as ``t`` (the param or its local tensor) has it; a
    streamed weight's is its host copy's, whatever ``.data`` is during a pass (an empty
    placeholder: Note [weight streaming]), so a state saved or loaded during a pass is exact
    (Note [streamed state dicts] in tiermem/stream/state_dicts.py).

    Raises:
        Nothing.
    """
    host = g.host_copies.get(i)
    return t.shape if host is None else host.shape


def torch_format(states: list[list[dict]], param_groups: list[dict]) -> dict:
    """torch.optim's ``state_dict`` layout: per-param states numbered across the groups, and
    each group's hyper-parameters with its params' numbers.

    Raises:
        Nothing.
    """
    flat_state, index, groups = {}, 0, []
    for g, hp in zip(states, param_groups):
        ids = list(range(index, index + len(g)))
        for i, st in zip(ids, g):
            flat_state[i] = st
        groups.append({**{k: v for k, v in hp.items() if k != "params"}, "params": ids})
        index += len(g)
    return {"state": flat_state, "param_groups": groups}


# Note [saved weight decay style]
# A load takes the saved group's hyper-parameters (lr, betas, eps, weight_decay, maximize,
# adamw), as torch's optimizers do, so a resumed run steps as the saved one did. torch.optim.Adam
# and AdamW save the decay style as ``decoupled_weight_decay``, which HybridAdam does not read:
# a torch Adam run (L2 decay) resumed into HybridAdam(adamw=True) went on with decoupled decay,
# and an AdamW run into adamw=False with L2, silently (tests/test_resume_exact.py). So a saved
# group without ``adamw`` gives its ``decoupled_weight_decay`` as ``adamw``. The other way round
# torch's optimizers do not read ``adamw`` (AdamW always decouples, Adam takes L2 when the
# saved group does not say): load_checkpoint refuses those loads (Note [checkpoint fit]).


def hyper_params_of(saved: dict) -> dict:
    """The hyper-parameters a load takes from the saved param group ``saved`` (all its keys
    but ``params``), with a torch Adam/AdamW group's ``decoupled_weight_decay`` as ``adamw``
    (Note [saved weight decay style]).

    Raises:
        Nothing.
    """
    hp = {k: v for k, v in saved.items() if k not in ("params", GRAD_ORDER)}
    if "adamw" not in hp and "decoupled_weight_decay" in hp:
        hp["adamw"] = bool(hp["decoupled_weight_decay"])
    return hp


# Note [saved gradient order]
# With placement="trace" the GPU side / offloaded split follows the first backward's gradient
# order (Note [trace placement] in state_setup.py). A HybridAdam that loads a state before its
# first backward (every resume) had no order yet, so the load fixed the split from the given
# order: a resumed run kept other params' state on the GPU than the run it resumed (on a GPU
# other last bits, as docs/compatibility.md says of the split, and the first layers' state
# offloaded where the traced run kept it on the GPU). So ``state_dict()`` saves each group's
# traced order (local tensor indices in gradient arrival order) under :data:`GRAD_ORDER`, and
# a load or ``check_state_dict`` before the first backward and before the state is allocated
# takes it as if that backward had given it. The key rides in the param groups (torch's
# optimizers carry it along unread); the load does not copy it into ``param_groups``. An
# order that does not fit the groups (another model's state) is not taken: the load's own
# checks refuse that state. Only one process traces (data parallel and FSDP2 place as given),
# and a state saved before any backward has no order: neither has the key, so a
# torch.distributed.checkpoint template made by a fresh optimizer has the keys of a sharded
# run's checkpoint (DCP refuses a template key the checkpoint lacks: a template made after
# training in one process has the key, and then needs a checkpoint that has it too).

GRAD_ORDER = "tiermem_grad_order"
"""The param-group key of Note [saved gradient order]."""


def with_grad_order(state_dict: dict, arrived: dict[tuple[int, int], int]) -> dict:
    """``state_dict`` (torch's format) with each group's traced gradient order, from
    ``arrived`` (``{(group, local index): arrival rank}``) (Note [saved gradient order]).

    Raises:
        Nothing.
    """
    if not arrived:  # nothing traced: no key (a template for DCP, which wants the same keys)
        return state_dict
    for gi, group in enumerate(state_dict["param_groups"]):
        group[GRAD_ORDER] = [i for _, i in sorted((rank, i) for (g, i), rank in arrived.items()
                                                  if g == gi)]
    return state_dict


def saved_grad_order(state_dict: dict, layout_groups: list[Group]) -> dict[tuple[int, int], int]:
    """The ``{(group, local index): arrival rank}`` saved in ``state_dict`` (empty when it has
    none, or one that does not fit ``layout_groups``) (Note [saved gradient order]).

    Raises:
        Nothing.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or len(groups) != len(layout_groups):
        return {}
    out: dict[tuple[int, int], int] = {}
    for gi, (saved, g) in enumerate(zip(groups, layout_groups)):
        order = saved.get(GRAD_ORDER) if isinstance(saved, dict) else None
        if not isinstance(order, (list, tuple)) or len(set(order)) != len(order) or \
                not all(type(i) is int and 0 <= i < g.n_local for i in order):
            return {}
        out.update({(gi, i): len(out) + k for k, i in enumerate(order)})
    return out
