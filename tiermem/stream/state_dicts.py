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
  the loading model was built with.
- **A load_state_dict pre-hook.** Refused during a pass (the backward needs the weights its
  forward read). A pending step is completed first (the worker's write-back would race the
  load; resident weights a load reaches before the first streamed block, the embeddings, still
  need ``opt.synchronize()`` first: Note [forward sync]). A host copy is loaded in place by torch (``param.copy_``: its version moves, so the
  next pass streams it, the NVMe copy is rewritten, and HybridAdam takes it into its masters:
  Note [param changes]). A weight homed on NVMe whose key is in the state dict gets a dense
  RAM tensor of its stand-in's NaN as ``.data`` for torch to copy into (one block at a time).
- **A load_state_dict post-hook** (after the block's weights were loaded): each such weight
  whose version moved (torch copied into it) is written to its NVMe copy and gets its stand-in
  back (``WeightStream.adopt``); one the load skipped (a shape error) gets its stand-in back
  unwritten. Should the load stop in between, the NaN tensor left as ``.data`` is refused at the
  next pass start and its NVMe copy kept (``NvmeHome.check_unwritten``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch

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

    def install(self) -> list:
        """Register the four hooks on every streamed block module; return their handles.

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
        return handles

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
                state[key] = p.host.detach()
        if left_out and not self._warned:
            self._warned = True
            logger.warning(
                "weight streaming: %d weights homed on NVMe (staging_blocks) are left out of "
                "model.state_dict(), e.g. %s: frozen, they are the base the model was built "
                "from (Note [streamed state dicts]); load such a state dict with strict=False",
                len(left_out), left_out[0])

    def _before_load(self, i: int, module: Any, state: dict, prefix: str, *args: Any) -> None:
        me = self._stream()
        if me is None:
            return
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
