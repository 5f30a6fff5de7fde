"""``model.state_dict()`` and ``model.load_state_dict()`` over streamed blocks: four hooks on
each streamed block module (Note [streamed state dicts]).

Note [streamed state dicts]: a checkpoint of a streamed model is ``model.state_dict()`` (and
``load_state_dict``) as for any model, but a streamed weight's ``.data`` is its host copy only
between passes (Note [weight streaming] in tiermem/stream/weights.py), and that copy is current
only once a connected HybridAdam has written it (Note [streamed write-back]). Each streamed block
module therefore gets:

- **A state_dict pre-hook.** An idle pass (its outputs dropped) is ended. A connected
  HybridAdam's pending ``param_sync="forward"`` step is completed: its worker may still be
  writing host copies, and ``torch.save(model.state_dict())`` right after ``step()`` held the
  step before's weights for every chunk not yet written (``Link.between_steps``). Refused, in
  one line naming the fix: chunks of a step ``step()`` has not taken yet were stepped during the
  backward (the host copies are half updated: Note [state between steps] in
  tiermem/optim/step_state.py); a pass whose backward has begun, or a block-major pass (its
  host copies may be written by then).
- **A state_dict post-hook.** During a pass, before its backward (a loss kept for logging
  holds the pass open), a released block's ``.data`` is an empty placeholder: a checkpoint
  saved there held empty tensors and silently lost those weights. Each streamed entry is
  replaced by its host copy, which holds the pass's weights (nothing writes a host copy between
  the pass start, where HybridAdam's step was completed, and its backward: an in-place change
  is refused at the next fill), so the checkpoint is exact. ``keep_vars=True`` (the parameters
  themselves wanted, whose data is on the device or nowhere) is refused then. A weight whose
  home is NVMe (``staging_blocks``, Note [NVMe home]) has a NaN stand-in as ``.data``: a
  checkpoint held NaN for it, and a fresh model loaded from it trained on NaN weights with no
  error. Reading those weights back would put the whole frozen base in RAM, which the NVMe
  home exists to avoid, so they are left out of the state dict (logged once per stream at
  WARNING): a strict load of it names them as missing keys; ``strict=False`` keeps the base
  the loading model was built with. Every entry over a ``tier="cpu"`` host copy, between
  passes too, then gets a storage of its own bytes (Note [exact state dict storage]).
- **A load_state_dict pre-hook.** Refused during a pass (the backward needs the weights its
  forward read), and with ``assign=True``, which puts the state dict's tensors in place of the
  streamed parameters (the next forward then refused them with a message about FSDP; the
  modules loaded before the first streamed block, the embeddings, are assigned by torch).
  A pending step is completed first (the worker's write-back would race the load; resident
  weights a load reaches before the first streamed block, the embeddings, still need
  ``opt.synchronize()`` first: Note [forward sync]). A host copy is loaded in place by
  torch (``param.copy_``: its version moves, so the next pass streams it, the NVMe copy is rewritten, and HybridAdam takes it into its masters:
  Note [param changes]). A weight homed on NVMe whose key is in the state dict gets a dense
  RAM tensor of its stand-in's NaN as ``.data`` for torch to copy into (one block at a time).
- **A load_state_dict post-hook** (after the block's weights were loaded): each such weight
  whose version moved (torch copied into it) is written to its NVMe copy and gets its stand-in
  back (``WeightStream.adopt``); one the load skipped (a shape error) gets its stand-in back
  unwritten. Should the load stop in between, the NaN tensor left as ``.data`` is refused at the
  next pass start and its NVMe copy kept (``NvmeHome.check_unwritten``).

Note [exact state dict storage]: with ``tier="cpu"`` a host copy is a view into a pool slab
(1 MiB to 1 GiB, shared with every other block cut from it: the other weights, and HybridAdam's
state when it shares the store), and ``torch.save`` writes a tensor's whole storage. So
``torch.save(model.state_dict())`` wrote every slab holding a streamed weight: a file as large
as those slabs, holding the bytes of the other keys in them (optimizer state, anything else
in the store); with two dtypes in one slab (fp32 norms beside bf16 matrices) torch.save
refused the state dict outright, and ``save_checkpoint`` held the slabs in memory once more
for its payload check. The post-hook therefore gives each such entry (between passes the
``param.detach()`` torch made, during a pass the host copy's ``detach()``) a storage of exactly
its own bytes over the same memory, by ``entry.data = exact_storage(host)`` (Note [exact
storage] in tiermem/store/exact.py): no copy, and the entry keeps the version counter it
shares with the parameter (between passes) as torch's does, so a write through it is seen as
an in-place change (Note [param changes]). As torch's, the entries are live views: a later step
or load changes them; ``sd = {k: v.clone() ...}`` keeps a snapshot. The host copy's block
stays where it is while the stream is open (its key is held), but ``close()`` deletes the keys
and the pool may hand the blocks to other keys: an entry still alive then would show their
bytes. So the hooks keep a weak reference to each entry they handed out, and the last handle
:meth:`StateDictHooks.install` returns (``close()`` removes the handles before it deletes the
keys) gives each entry still alive a copy of its bytes, as a torch state dict entry keeps the
old storage when ``param.data`` is replaced. ``keep_vars=True`` between passes returns the
parameters themselves (torch's contract): their ``.data`` is the pool view, so
``torch.save`` of that still writes slabs; checkpoints take ``keep_vars=False``. With
``tier="nvme"`` a host copy is a tensor of its own (nothing to do), and weights homed on
NVMe are left out.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch

from tiermem.store.exact import exact_storage, owns_exactly

logger = logging.getLogger("tiermem")


class StateDictHooks:
    """The hooks of Note [streamed state dicts] for one WeightStream (held weakly).

    Args:
        stream: the WeightStream.
    """

    def __init__(self, stream: Any) -> None:
        self._ref = weakref.ref(stream)
        self._loading: dict[int, list[tuple[Any, int]]] = {}  # block -> (Param, version)
        self._warned = False  # the NVMe home's weights left out: logged once
        # Note [exact state dict storage]: (entry, its data_ptr) handed out over a pool block
        self._lent: list[tuple[weakref.ref, int]] = []
        self._pruned = 0  # live entries at the last prune

    def install(self) -> list:
        """Register the four hooks on every streamed block module; return their handles, the
        last of which lets go of the pool blocks (Note [exact state dict storage]).

        Raises:
            nothing.
        """
        stream = self._ref()
        handles = []
        for module, block in zip(stream.modules, stream._blocks):
            if not block.params:
                continue
            i = block.index
            handles += [
                module.register_state_dict_pre_hook(self._before_save),
                module.register_state_dict_post_hook(functools.partial(self._saved, i)),
                module.register_load_state_dict_pre_hook(functools.partial(self._before_load,
                                                                           i)),
                module.register_load_state_dict_post_hook(functools.partial(self._loaded, i))]
        return handles + [_LetGo(self)]

    def _stream(self) -> Any:
        me = self._ref()
        return None if me is None or me.closed else me

    def _before_save(self, module: Any, prefix: str, keep_vars: bool) -> None:
        me = self._stream()
        if me is None:
            return
        me._settle_idle_pass()
        ps = me._pass
        if ps is not None and (me._major is not None or ps.backward_started):
            raise RuntimeError(
                "model.state_dict() during the backward of a weight-streaming pass (or a "
                "block-major pass): the streamed weights' host copies may be half written "
                "(Note [streamed state dicts]); call it after the backward has ended")
        if me._link is not None:
            me._link.between_steps("model.state_dict()")

    def _saved(self, i: int, module: Any, state: dict, prefix: str, meta: Any) -> None:
        me = self._stream()
        if me is None:
            return
        left_out = []
        for p in me._blocks[i].params:
            key = prefix + p.name
            if key not in state:
                continue
            if me._home is not None:  # a NaN stand-in (Note [NVMe home])
                del state[key]
                left_out.append(key)
            elif me._pass is not None:  # a placeholder or the device buffer: the host copy
                if state[key] is p.param:
                    raise RuntimeError(
                        f"model.state_dict(keep_vars=True) during a weight-streaming pass: "
                        f"{key} holds no data until the backward has ended "
                        f"(Note [streamed state dicts]); call it after backward(), or with "
                        f"keep_vars=False")
                state[key] = self._exact(p.host.detach(), p.host)
            else:  # torch's param.detach() over the host copy (unless .data was replaced)
                entry = state[key]
                if entry is not p.param and isinstance(entry, torch.Tensor) \
                        and entry.data_ptr() == p.host.data_ptr() \
                        and entry.dtype == p.host.dtype and entry.shape == p.host.shape \
                        and entry.stride() == p.host.stride():
                    self._exact(entry, p.host)
        if left_out and not self._warned:
            self._warned = True
            logger.warning(
                "weight streaming: %d weights homed on NVMe (staging_blocks) are left out of "
                "model.state_dict(), e.g. %s: frozen, they are the base the model was built "
                "from (Note [streamed state dicts]); load such a state dict with strict=False",
                len(left_out), left_out[0])

    def _exact(self, entry: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """``entry`` (over ``host``'s bytes) with a storage of exactly those bytes, remembered
        until the stream closes; return it (Note [exact state dict storage])."""
        if owns_exactly(host):  # tier="nvme": a host tensor of its own
            return entry
        entry.data = exact_storage(host)  # keeps entry's version counter; bumps no version
        self._lent.append((weakref.ref(entry), entry.data_ptr()))
        if len(self._lent) > 2 * self._pruned + 64:  # forget the entries that died
            self._lent = [(ref, ptr) for ref, ptr in self._lent if ref() is not None]
            self._pruned = len(self._lent)
        return entry

    def let_go(self) -> None:
        """Give every state dict entry handed out over a pool block and still alive a copy of
        its bytes, all copies made before any is swapped in (Note [exact state dict storage]).

        Raises:
            RuntimeError (out of memory): a copy failed; no entry changed and the blocks are
                still the stream's.
        """
        live = [t for t, ptr in ((ref(), ptr) for ref, ptr in self._lent)
                if t is not None and t.data_ptr() == ptr]
        copies = [t.clone() for t in live]
        for t, copy in zip(live, copies):
            t.data = copy
        self._lent.clear()
        self._pruned = 0

    def _before_load(self, i: int, module: Any, state: dict, prefix: str, *args: Any) -> None:
        me = self._stream()
        if me is None:
            return
        if args and isinstance(args[0], dict) and args[0].get("assign_to_params_buffers"):
            raise RuntimeError(  # (local_metadata) Note [streamed state dicts]
                f"model.load_state_dict(assign=True) reached streamed blocks[{i}]: it would put "
                f"the state dict's tensors in place of the parameters the stream moves; load "
                f"with assign=False (the default: the values are copied into the streamed "
                f"weights), or close() the stream first")
        me._settle_idle_pass()
        if me._pass is not None:
            raise RuntimeError(
                f"model.load_state_dict() during a weight-streaming pass: blocks[{i}]'s "
                f"weights are those of the open forward, which its backward needs (Note "
                f"[streamed state dicts]); load after backward() or drop the forward's outputs")
        if me._link is not None:
            me._link.between_steps("model.load_state_dict()")
        if me._home is None:
            return
        loading = []
        for p in me._blocks[i].params:
            new = state.get(prefix + p.name)
            if isinstance(new, torch.Tensor) and new.shape == p.host.shape \
                    and p.param.data.data_ptr() == p.host.data_ptr():
                p.param.data = p.host.clone(memory_format=torch.contiguous_format)  # NaN
                loading.append((p, p.param._version))
        self._loading[i] = loading

    def _loaded(self, i: int, module: Any, incompatible: Any) -> None:
        me = self._stream()
        loading = self._loading.pop(i, [])
        if me is None:
            return
        for p, version in loading:
            if p.param._version == version:  # not loaded: the stand-in again, nothing written
                p.param.data = p.host
        for p, version in loading:
            if p.param._version != version:
                me.adopt(p.param)  # to NVMe, the stand-in again (Note [NVMe home])


class _LetGo:
    """Not a torch hook: the handle ``WeightStream.close()`` removes with the others, before
    it deletes the store keys, so that no state dict entry still alive points into a block the
    pool may reuse (Note [exact state dict storage]).

    Args:
        hooks: the StateDictHooks that handed the entries out.
    """

    def __init__(self, hooks: StateDictHooks) -> None:
        self._hooks = hooks

    def remove(self) -> None:
        """:meth:`StateDictHooks.let_go`.

        Raises:
            RuntimeError (out of memory): as :meth:`StateDictHooks.let_go`.
        """
        self._hooks.let_go()
