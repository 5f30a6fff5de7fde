"""HybridAdam and activation offload through ``transformers.Trainer`` (and TRL's trainers).

::

    from tiermem.integrations.hf import TiermemTrainer
    trainer = TiermemTrainer(model=model, args=TrainingArguments(..., bf16=True),
                             train_dataset=ds,
                             hybrid_adam={"offload_fraction": 1.0, "state_tier": "cpu"},
                             activation_offload=True)
    trainer.train()

    SFT = with_tiermem(trl.SFTTrainer)   # the same for any Trainer subclass

Note [trainer clipping]: Trainer clips between backward and ``optimizer.step()`` with
``accelerator.clip_grad_norm_`` and, with ``max_grad_norm <= 0``, still calls it with an infinite
norm to log ``grad_norm``; both multiplied every gradient in place (by 1.0 in the second case;
accelerate 1.16 takes the norm alone at an infinite ``max_norm``, older versions do not).
HybridAdam copies gradients off the GPU in backward (overlap) and clips inside ``step()``
itself, so an in-place change after backward is either refused (its version check) or, with
its own clip, silently applied twice (the clip coefficient of already clipped gradients is not
exactly 1). The trainer therefore leaves the gradients alone: ``_clip_grad_norm`` and
``_get_grad_norm`` return the global 2-norm of the optimizer's gradients, computed out of
place with ``torch.nn.utils.get_total_norm`` over the same list, in the same order, that
HybridAdam clips by, and that value is what Trainer logs as ``grad_norm`` (before clipping, as
Trainer logs it). HybridAdam clips with ``max_grad_norm=args.max_grad_norm``.

Note [trainer accumulation]: Trainer divides each micro-batch's loss by the number of
micro-batches of the window (or normalises by ``num_items_in_batch`` over the window), runs
backward once per micro-batch and calls ``optimizer.step()`` and ``model.zero_grad()`` once, on
the window's last micro-batch (``sync_gradients``). The gradients HybridAdam sees at ``step()``
are therefore the ones AdamW sees. ``grad_accumulation_steps=args.gradient_accumulation_steps``
makes its hooks hand gradients over on the window's last backward only; a shorter last window
of an epoch ships them in ``step()`` (it never ships early). A window longer than it would be
refused by ``step()``.

Note [trainer optimizer wrap]: ``accelerator.prepare`` wraps an optimizer in
``AcceleratedOptimizer(device_placement=True)``, whose constructor moves ``state_dict()`` to
the GPU and loads it back: the whole optimizer state (and, before the first backward, HybridAdam's
placement decision) would be materialised on the GPU once. The trainer builds the wrapper
itself with ``device_placement=False`` and marks it prepared, so ``prepare`` keeps it as is
(``Accelerator.prepare_optimizer`` returns an object marked ``_is_accelerate_prepared``). Trainer's
checkpoint then saves ``optimizer.state_dict()`` (full CPU tensors gathered from the GPU side,
RAM and NVMe) into ``optimizer.pt``, and ``resume_from_checkpoint`` loads it with
``map_location="cpu"`` into HybridAdam, which scatters it into the GPU side, RAM and NVMe.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tiermem.integrations.layers import find_decoder_layers
from tiermem.integrations.trainer_setup import (check_optimizer, check_options,
                                                hybrid_adam_kwargs, refusal)
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

try:
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("tiermem.integrations.hf needs transformers and accelerate: "
                      "pip install 'tiermem[hf]'") from exc

logger = logging.getLogger("tiermem")

_PRIVATE = ("_clip_grad_norm", "_get_grad_norm")


def _offload_options(activation_offload: Any) -> dict | None:
    """``activation_offload`` as offload_activations' keyword arguments plus ``blocks``.

    Raises:
        TypeError: not a bool or a dict with string keys.
    """
    if activation_offload is False or activation_offload is None:
        return None
    if activation_offload is True:
        return {}
    if not isinstance(activation_offload, dict) or not all(
            isinstance(k, str) for k in activation_offload):
        raise TypeError(f"activation_offload must be True, False or a dict of "
                        f"offload_activations keyword arguments (plus 'blocks': the dotted path "
                        f"of the layer list), got {type(activation_offload).__name__}")
    return dict(activation_offload)


class TiermemTrainerMixin:
    """Mix into a ``transformers.Trainer`` (subclass) before it: HybridAdam as the optimizer
    and/or tiermem's activation offload. See :func:`with_tiermem` and :class:`TiermemTrainer`.

    Args (keyword, besides the trainer's own):
        hybrid_adam: ``None``/``True``: HybridAdam with its defaults; a dict: HybridAdam keyword
            arguments (``offload_fraction``, ``state_tier``, ``nvme_dir``, ``store``,
            ``param_sync``, ``moments_dtype``, ...; not the ones the TrainingArguments own:
            Note [trainer owns the hyper-parameters]); ``False``: keep Trainer's optimizer.
            A HybridAdam given as ``optimizers=(opt, None)`` is used as is (its clip and
            accumulation must match the TrainingArguments).
        activation_offload: ``True``: :func:`~tiermem.offload.offload_activations` (layers
            ``"auto"``) over the model's decoder layers (Note [decoder layers]) around each
            training step, the meaning of TRL's ``activation_offloading=True``; combines with
            ``activation_checkpointing=True`` (the checkpoints' inputs are offloaded); a dict:
            its keyword arguments, plus ``"blocks"``: the dotted path of the layer list.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option the TrainingArguments own, a setup that cannot work (DeepSpeed,
            FSDP, several processes, fp16, another optimizer named in ``optim``, two activation
            offloaders), no decoder layers found, or a transformers without the methods
            overridden here.
    """

    def __init__(self, *args: Any, hybrid_adam: Any = None, activation_offload: Any = False,
                 **kwargs: Any) -> None:
        options = check_options(hybrid_adam)
        offload = _offload_options(activation_offload)
        missing = [name for name in _PRIVATE if not hasattr(Trainer, name)]
        if options is not None and missing:
            raise ValueError(f"this transformers ({Trainer.__module__}) has no Trainer."
                             f"{missing[0]}, which the tiermem trainer overrides to keep "
                             f"Trainer from clipping (Note [trainer clipping]); use "
                             f"transformers 5.x")
        super().__init__(*args, **kwargs)
        why = refusal(self, options is not None, offload is not None)
        if why is None and options is not None and self.optimizer is not None and not (
                isinstance(self.optimizer, HybridAdam)):
            why = (f"optimizers=({type(self.optimizer).__name__}, ...) is given and hybrid_adam "
                   f"would replace it; pass hybrid_adam=False to keep it")
        if why is not None:
            raise ValueError(f"tiermem trainer: {why}")
        self._tiermem_options = options
        self._tiermem_offloader = None
        if offload is not None:
            blocks = find_decoder_layers(self.model, offload.pop("blocks", None))
            self._tiermem_offloader = offload_activations(blocks, **offload)
            logger.info("tiermem trainer: activation offload over %d decoder layers",
                        len(blocks))

    # ------------------------------------------------------------------ the optimizer

    @property
    def hybrid_adam(self) -> HybridAdam | None:
        """The HybridAdam the trainer steps (``None`` before ``train()`` or without one)."""
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        return opt if isinstance(opt, HybridAdam) else None

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Build HybridAdam on Trainer's decay / no-decay groups, wrapped for Accelerate
        without device placement (Note [trainer optimizer wrap]).

        Raises:
            ValueError: a HybridAdam given by the user clips or accumulates differently from
                the TrainingArguments; HybridAdam's own errors for its options.
        """
        if self._tiermem_options is None:
            return super().create_optimizer(model)
        if self.optimizer is None:
            self.optimizer_cls_and_kwargs = (HybridAdam, hybrid_adam_kwargs(
                self.args, self._tiermem_options))
            try:  # Trainer's own grouping: get_decay_parameter_names, requires_grad only
                super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = None
        inner = self.hybrid_adam
        check_optimizer(inner, self.args)
        if not isinstance(self.optimizer, AcceleratedOptimizer):
            wrapped = AcceleratedOptimizer(inner, device_placement=False, scaler=None)
            wrapped._is_accelerate_prepared = True  # prepare() keeps it (no state round trip)
            self.optimizer = wrapped
        return self.optimizer

    def _tiermem_grad_norm(self) -> torch.Tensor | None:
        """Note [trainer clipping]: the global 2-norm HybridAdam clips by, out of place."""
        grads = [p.grad for group in self.hybrid_adam.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads, 2.0)

    def _clip_grad_norm(self, model: Any) -> Any:
        """Note [trainer clipping]: HybridAdam clips in ``step()``; return the norm only."""
        if self.hybrid_adam is None:
            return super()._clip_grad_norm(model)
        return self._tiermem_grad_norm()

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """Note [trainer clipping]: the norm for the logs, gradients left untouched."""
        if self.hybrid_adam is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._tiermem_grad_norm()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train()``; afterwards every parameter holds its last update (with
        ``param_sync="forward"`` the last step may still be writing offloaded ones).

        Raises:
            RuntimeError: HybridAdam's last CPU step failed; Trainer's own errors.
        """
        output = super().train(*args, **kwargs)
        if self.hybrid_adam is not None:
            self.hybrid_adam.synchronize()
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save as Trainer does, after HybridAdam's last step has written every parameter
        (``param_sync="forward"`` may still be updating offloaded ones)."""
        if self.hybrid_adam is not None:
            self.hybrid_adam.synchronize()
        super().save_model(output_dir, _internal_call=_internal_call)

    # ------------------------------------------------------------------ activation offload

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Trainer's training step (forward and backward) inside the activation offload
        context, as TRL's ``activation_offloading`` wraps it."""
        if self._tiermem_offloader is None:
            return super().training_step(*args, **kwargs)
        with self._tiermem_offloader:
            return super().training_step(*args, **kwargs)

    @property
    def activation_offloader(self) -> Any:
        """The :class:`~tiermem.offload.ActivationOffloader` (``None`` without offload)."""
        return self._tiermem_offloader


def with_tiermem(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass such as TRL's ``SFTTrainer``)
    with :class:`TiermemTrainerMixin` mixed in.

    Raises:
        TypeError: ``trainer_cls`` is not a subclass of ``transformers.Trainer``.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"with_tiermem: trainer_cls must be transformers.Trainer or a subclass, "
                        f"got {trainer_cls!r}")
    if issubclass(trainer_cls, TiermemTrainerMixin):
        return trainer_cls
    return type(f"Tiermem{trainer_cls.__name__}", (TiermemTrainerMixin, trainer_cls),
                {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__})


class TiermemTrainer(TiermemTrainerMixin, Trainer):
    """``transformers.Trainer`` with HybridAdam and tiermem's activation offload: see
    :class:`TiermemTrainerMixin` for the two extra keyword arguments."""
