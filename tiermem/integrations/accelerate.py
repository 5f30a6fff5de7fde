"""HybridAdam in an Accelerate loop: :class:`TiermemAccelerator`, an ``accelerate.Accelerator``
whose ``prepare``, ``clip_grad_norm_``, ``save_state`` and ``load_state`` keep HybridAdam exact.

::

    from tiermem.integrations.accelerate import TiermemAccelerator
    accelerator = TiermemAccelerator(gradient_accumulation_steps=2)
    opt = HybridAdam(model.parameters(), lr=1e-3, max_grad_norm=1.0, grad_accumulation_steps=2)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the norm; no clip here
            opt.step(); sched.step(); opt.zero_grad()

Note [accelerate clipping]: ``Accelerator.clip_grad_norm_`` multiplies every gradient in place
between backward and ``step()``. HybridAdam clips inside ``step()`` (``max_grad_norm``) and, with
overlap, has taken gradients in backward, so an in-place clip is either refused by its step
(the gradient changed after backward) or, with its own clip on, applied twice (the coefficient
of an already clipped gradient is ``1 / (1 + 1e-6 / norm)``, not 1). For parameters HybridAdam
owns, :meth:`TiermemAccelerator.clip_grad_norm_` therefore leaves the gradients alone and
returns the global 2-norm HybridAdam clips by (out of place, its gradients in its group order,
as Note [trainer clipping] in tiermem/integrations/hf.py does for Trainer). It refuses what it
cannot honour: a ``max_norm`` other than HybridAdam's ``max_grad_norm`` (``inf``: HybridAdam
must not clip), a norm other than 2, a parameter list that is not exactly HybridAdam's
parameters with gradients, and a call off the accumulation boundary (``sync_gradients``
False: clipping part of a window is not what HybridAdam's step does).

Note [accelerate accumulation]: ``accelerator.accumulate`` sets ``sync_gradients`` on every
``gradient_accumulation_steps``-th micro-batch and on the dataloader's last one;
``accelerator.backward`` divides each loss by ``gradient_accumulation_steps``;
``AcceleratedOptimizer.step`` and ``zero_grad`` call HybridAdam only when ``sync_gradients``
is set. HybridAdam therefore sees one ``step()`` per window, over the window's summed
gradients, like AdamW. Its ``grad_accumulation_steps`` must equal the accelerator's (its hooks
ship gradients on the window's last backward; a shorter last window ships in ``step()``):
``prepare`` refuses a mismatch.

Note [accelerate optimizer wrap]: ``Accelerator.prepare_optimizer`` builds
``AcceleratedOptimizer(device_placement=True)``, whose constructor round-trips
``state_dict()`` through the accelerator's device: the whole optimizer state on the GPU once
(Note [trainer optimizer wrap]). :meth:`TiermemAccelerator.prepare_optimizer` wraps a
HybridAdam with ``device_placement=False`` and no GradScaler. ``save_state`` saves
``optimizer.state_dict()`` (full CPU tensors from the GPU side, RAM and NVMe) in
``optimizer.bin``; ``load_state`` in one process loads it with ``map_location="cpu"`` after the
model's weights (taken into HybridAdam's masters: Note [param changes]). Both first complete a
pending ``param_sync="forward"`` step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable

import torch

from tiermem.optim import HybridAdam

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("tiermem.integrations.accelerate needs accelerate: "
                      "pip install 'tiermem[hf]'") from exc

logger = logging.getLogger("tiermem")


def unwrap(opt: Any) -> Any:
    """The optimizer inside any ``AcceleratedOptimizer`` wrappers.

    Raises:
        Nothing.
    """
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def accelerate_refusal(accelerator: Any) -> str | None:
    """Why HybridAdam cannot run under this accelerator's setup, or ``None`` if it can
    (reads attributes only).

    Raises:
        Nothing.
    """
    kind = getattr(accelerator, "distributed_type", DistributedType.NO)
    if kind == DistributedType.DEEPSPEED:
        return ("Accelerate's DeepSpeed plugin wraps the optimizer in its ZeRO optimizer, which "
                "steps flattened fp32 partitions of its own (and offloads with its own CPU "
                "Adam): HybridAdam would never see the model's parameters. Drop the DeepSpeed "
                "plugin to use HybridAdam, or drop HybridAdam")
    if kind == DistributedType.FSDP:
        return ("Accelerate's FSDP plugin shards the model after the optimizer was built and "
                "swaps its parameters, which HybridAdam has already partitioned. Drop the "
                "plugin; HybridAdam steps FSDP2 shards when it is built after fully_shard in a "
                "plain torch.distributed loop")
    if kind in (DistributedType.MEGATRON_LM, DistributedType.XLA):
        return f"distributed_type={kind.value}: HybridAdam runs on CUDA or CPU devices only"
    processes = getattr(accelerator, "num_processes", 1)
    if processes > 1:
        return (f"num_processes={processes}: Accelerate would wrap the model in DDP, whose "
                f"gradient all-reduce HybridAdam's hooks do not wait for; run one process, or "
                f"HybridAdam(data_parallel=True) in a plain torch.distributed loop")
    if getattr(accelerator, "mixed_precision", "no") == "fp16":
        return ("mixed_precision='fp16': Accelerate's GradScaler unscales gradients in place "
                "after backward, where HybridAdam's overlap has taken them, and this wrapper "
                "steps HybridAdam without it; use mixed_precision='bf16' (HybridAdam takes a "
                "torch.amp.GradScaler in a plain loop, with overlap=False or max_grad_norm: "
                "Note [grad scaler])")
    return None


class TiermemAccelerator(Accelerator):
    """``accelerate.Accelerator`` for loops that step a :class:`~tiermem.optim.HybridAdam`
    (other optimizers are prepared as Accelerate does). Takes Accelerator's arguments.

    Raises (from ``prepare``/``prepare_optimizer``):
        ValueError: a HybridAdam under DeepSpeed, FSDP, several processes or fp16, or whose
            ``grad_accumulation_steps`` differs from the accelerator's.
    """

    def _hybrid_adams(self) -> list[HybridAdam]:
        return [o for o in map(unwrap, self._optimizers) if isinstance(o, HybridAdam)]

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """``Accelerator.prepare``, refusing a HybridAdam where it cannot work before any
        plugin touches it (DeepSpeed and FSDP do not go through ``prepare_optimizer``).

        Raises:
            ValueError: see the class.
        """
        if any(isinstance(unwrap(a), HybridAdam) for a in args):
            why = accelerate_refusal(self)
            if why is not None:
                raise ValueError(f"TiermemAccelerator: {why}")
        return super().prepare(*args, device_placement=device_placement)

    def prepare_optimizer(self, optimizer: Any, device_placement: Any = None) -> Any:
        """A HybridAdam is wrapped without the state round trip (Note [accelerate optimizer
        wrap]); any other optimizer as Accelerate does.

        Raises:
            ValueError: see the class.
        """
        inner = unwrap(optimizer)
        if not isinstance(inner, HybridAdam) or getattr(optimizer, "_is_accelerate_prepared",
                                                        False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        why = accelerate_refusal(self)
        if why is None and inner.grad_accumulation_steps != self.gradient_accumulation_steps:
            why = (f"HybridAdam(grad_accumulation_steps={inner.grad_accumulation_steps}) but "
                   f"Accelerator(gradient_accumulation_steps={self.gradient_accumulation_steps})"
                   f": build HybridAdam with grad_accumulation_steps="
                   f"{self.gradient_accumulation_steps} (Note [accelerate accumulation])")
        if why is not None:
            raise ValueError(f"TiermemAccelerator: {why}")
        wrapped = AcceleratedOptimizer(inner, device_placement=False, scaler=None)
        wrapped._is_accelerate_prepared = True
        self._optimizers.append(wrapped)
        return wrapped

    def clip_grad_norm_(self, parameters: Iterable, max_norm: float,
                        norm_type: float = 2) -> Any:
        """Note [accelerate clipping]: for a HybridAdam's parameters, the 2-norm it clips by,
        gradients untouched; otherwise ``Accelerator.clip_grad_norm_``.

        Raises:
            ValueError: ``max_norm``/``norm_type`` differ from what HybridAdam clips by, the
                parameters are not exactly a HybridAdam's (with gradients), or the call is
                off the accumulation boundary.
        """
        params = [p for p in parameters if p.grad is not None]
        ids = {id(p) for p in params}
        for opt in self._hybrid_adams():
            owned = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            shared = ids & {id(p) for p in owned}
            if not shared:
                continue
            if len(shared) != len(ids) or len(shared) != len(owned):
                raise ValueError(f"TiermemAccelerator.clip_grad_norm_: {len(ids)} parameters "
                                 f"with gradients given, HybridAdam has {len(owned)}, "
                                 f"{len(shared)} in common: clip exactly HybridAdam's parameters "
                                 f"(e.g. model.parameters()) (Note [accelerate clipping])")
            want = None if math.isinf(float(max_norm)) else float(max_norm)
            if float(norm_type) != 2.0 or opt.max_grad_norm != want:
                raise ValueError(f"TiermemAccelerator.clip_grad_norm_(max_norm={max_norm}, "
                                 f"norm_type={norm_type}) but HybridAdam(max_grad_norm="
                                 f"{opt.max_grad_norm}) clips by the 2-norm inside step(): "
                                 f"build it with max_grad_norm={want} "
                                 f"(Note [accelerate clipping])")
            if not self.sync_gradients:
                raise ValueError("TiermemAccelerator.clip_grad_norm_ off the accumulation "
                                 "boundary (sync_gradients is False): HybridAdam clips the "
                                 "window's gradients in step(); call it under `if "
                                 "accelerator.sync_gradients:` (Note [accelerate clipping])")
            return torch.nn.utils.get_total_norm([p.grad for p in owned], 2.0)
        return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def _synchronize(self) -> None:
        for opt in self._hybrid_adams():
            opt.synchronize()  # a param_sync="forward" step may still be writing params

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """``Accelerator.save_state`` after HybridAdam's last step has written every param
        (Note [accelerate optimizer wrap]).

        Raises:
            RuntimeError: HybridAdam's pending step failed; Accelerate's own errors.
        """
        self._synchronize()
        return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **kwargs: Any) -> None:
        """``Accelerator.load_state`` after HybridAdam's pending step; the optimizer state is
        read to the CPU and scattered into HybridAdam's tiers.

        Raises:
            RuntimeError: HybridAdam's pending step failed; Accelerate's own errors.
        """
        self._synchronize()
        if self._hybrid_adams():
            kwargs.setdefault("map_location", "cpu")
        return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict:
        """``Accelerator.get_state_dict`` after HybridAdam's pending step.

        Raises:
            RuntimeError: HybridAdam's pending step failed.
        """
        self._synchronize()
        return super().get_state_dict(model, unwrap=unwrap)
