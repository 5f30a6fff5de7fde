"""HybridAdam's groups, private store and state allocation: the constructor partitions each
param group into a GPU side and offloaded chunks (:func:`make_groups`) and, given no store,
makes one sized for them (:func:`private_store_for`); the state is allocated at construction,
or with ``placement="trace"`` at the first ``step()`` (or the first call that needs it), once
the first backward has given the gradient order (:func:`ensure_state`). The optimizer is
passed in: this module never imports ``hybrid_adam``.

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
gradients seen so far, else (``load_state_dict``, ``check_state_dict``) the order the loaded
state was traced with (Note [saved gradient order] in state_dict.py), else the given order.
``placement="given"``: the given order, state allocated at construction.
"""

from __future__ import annotations

from typing import Any

from tiermem.optim.layout import Group, private_store
from tiermem.optim.modes import Mode
from tiermem.optim.partition import auto_chunk_numel, plan_group
from tiermem.optim.state_dict import check_loadable, saved_grad_order
from tiermem.store.store import TierStore


def make_groups(mode: Mode, param_groups: list[dict], offload_fraction: float,
                chunk_numel: int | None) -> tuple[list[Group], int]:
    """The groups of local tensors ``mode`` says this rank steps, each partitioned into GPU
    side and offloaded chunks (``offload_fraction`` of its bytes offloaded); and
    ``chunk_numel`` (elements per chunk; sized from the local elements when ``None``).

    Raises:
        Nothing of its own (the params were checked by the constructor).
    """
    shapes = [mode.local_shapes(gi, list(g["params"])) for gi, g in enumerate(param_groups)]
    if chunk_numel is None:
        local = sum(sum(numels) for numels, _, _ in shapes)
        chunk_numel = auto_chunk_numel(int(local * offload_fraction))
    groups = []
    for gi, (g, (numels, sizes, segments)) in enumerate(zip(param_groups, shapes)):
        group = Group(gi, list(g["params"]),
                      plan_group(numels, sizes, offload_fraction, chunk_numel),
                      [0] * len(numels), len(numels), segments, numels=numels, sizes=sizes)
        group.locals_in_bucket.update(mode.buckets_of(gi))
        groups.append(group)
    return groups, chunk_numel


def private_store_for(opt: Any, nvme_dir: str | None) -> TierStore:
    """A store sized for the state of HybridAdam ``opt`` (its groups, ``chunk_numel``,
    ``moments_dtype``, tier and device set); ``nvme_dir``: its spill directory, per rank when
    distributed.

    Raises:
        ValueError, OSError: the spill directory cannot be used.
    """
    if opt.state_tier == "nvme":
        nvme_dir = opt._mode.spill_dir(nvme_dir)
    return private_store(opt._groups, chunk_numel=opt.chunk_numel,
                         moments_dtype=opt.moments_dtype,
                         lookahead_chunks=opt.nvme_lookahead_chunks,
                         state_tier=opt.state_tier, device=opt.device, nvme_dir=nvme_dir)


def init_state(opt: Any) -> None:
    """Allocate HybridAdam ``opt``'s state (GPU side, store buffers and chunks, the lane's
    slots); on any failure (a full store or disk) undo all of it, so a later call starts afresh.

    Raises:
        TierFullError: the store has no room for a buffer or a chunk.
    """
    try:
        opt._layout.alloc()
        opt._lane.init()
        opt._watch.record_all()  # the masters were copied from the params as they are
    except BaseException:
        opt._layout.undo()
        opt._lane.clear()
        raise


def ensure_state(opt: Any, loading: dict | None = None) -> None:
    """Note [trace placement]: plan HybridAdam ``opt``'s partition from the recorded gradient
    order (when there is one; else the order traced for ``loading``, a state dict about to be
    loaded or checked: Note [saved gradient order]) and allocate the state, once.

    Raises:
        TierFullError: the store has no room for the state; nothing is left half-allocated.
    """
    if opt._state_ready:
        return
    order = {}
    if loading is not None and opt._trace_placement:
        try:
            check_loadable(loading, opt._groups, opt._who)  # (another model's: not its order)
            order = saved_grad_order(loading, opt._groups)
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # the load's own checks refuse it
    with opt._step.lock:
        if not opt._arrived:
            opt._arrived.update(order)
        arrived = dict(opt._arrived)
    opt._layout.replan(arrived)
    init_state(opt)
    opt._state_ready = True
    with opt._step.stats_lock:  # the step's I/O counts from here: allocation is not streaming
        opt._moved0 = dict(opt._store.stats()["moved_bytes"])
    opt._chunks_of = opt._layout.param_chunks()
    opt._read_ahead.plan_changed()
    with opt._step.lock:
        opt._step.chunk_missing = opt._layout.params_per_chunk()
    opt._read_ahead.first_chunks()
