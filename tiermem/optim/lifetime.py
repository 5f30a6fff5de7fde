"""How a HybridAdam ends: its store-key owner numbers, the weak references its hooks call it
through and its finalizer.

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

Note [one optimizer per param]: a HybridAdam's gradient hooks hand gradients to its worker,
which writes the updated parameters back during backward, for as long as it is open. A second
HybridAdam built over the same parameters while the first is still open (a re-created optimizer
after a resume, the old one still held by a trainer or a list) had both step them: the second
one's first step failed with a misleading race error ("changed while the step was still
updating it (param_sync='forward')"), and which update a parameter held depended on timing. So
:func:`claim_params` refuses, at construction, a parameter an open HybridAdam in this process
already steps, naming the fix (``close()`` the other first, or drop it); ``close()`` and the
finalizer end the claim (tests/optim/test_one_optimizer_per_param.py).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import weakref
from typing import Any

import torch

from tiermem.optim.chunk_worker import stop_thread
from tiermem.optim.layout import free_owner_keys
from tiermem.store.store import StoreClosedError, TierStore

OWNERS = itertools.count()  # Note [lifetime]: the owner number in a HybridAdam's store keys


def call_weak_forward(ref: weakref.ref, module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook (param_sync="forward") through a weak reference."""
    opt = ref()
    if opt is not None:
        opt._before_forward(module, args)


def release(work: queue.Queue, worker: threading.Thread, hooks: list, ram_held: list,
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


_CLAIMS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""``id(param)`` -> (the param, the HybridAdam that steps it), both weakly (Note [one optimizer
per param]); an entry whose param or optimizer is gone, or whose optimizer is closed, is free."""


def _open(opt: Any) -> bool:
    """Whether HybridAdam ``opt`` (None: collected) is still open: its finalizer has not run."""
    finalizer = getattr(opt, "_finalizer", None) if opt is not None else None
    return finalizer is not None and finalizer.alive


def claim_params(opt: Any, params: list[torch.Tensor], who: str) -> None:
    """Record that ``opt`` steps ``params``, after refusing any of them an open HybridAdam
    already steps (Note [one optimizer per param]).

    Raises:
        ValueError: names the parameter (its index and shape) and the fix.
    """
    for i, p in enumerate(params):
        entry = _CLAIMS.get(id(p))
        if entry is None or entry[0]() is not p:
            continue
        other = entry[1]()
        if other is not opt and _open(other):
            raise ValueError(
                f"{who}: param {i} (shape {tuple(p.shape)}) is already stepped by another "
                f"HybridAdam that is still open: its gradient hooks would step it too, writing "
                f"the parameter during this one's backward; call close() on the other first "
                f"(or drop every reference to it), or build one HybridAdam over all the params")
    for key in [k for k, (pr, orf) in _CLAIMS.items() if pr() is None or not _open(orf())]:
        del _CLAIMS[key]  # the claims of collected params and closed optimizers
    mine = weakref.ref(opt)
    for p in params:
        _CLAIMS[id(p)] = (weakref.ref(p), mine)
