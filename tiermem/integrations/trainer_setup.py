"""What a ``transformers.Trainer`` run must look like for HybridAdam, and HybridAdam's arguments
taken from its ``TrainingArguments`` (no transformers import here: the checks read attributes).

Note [trainer owns the hyper-parameters]: ``lr``, ``betas``, ``eps``, ``weight_decay``,
``max_grad_norm`` and ``grad_accumulation_steps`` come from the ``TrainingArguments``
(``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``weight_decay``,
``max_grad_norm``, ``gradient_accumulation_steps``), read when the optimizer is built, so that
one value drives both Trainer and HybridAdam; giving them again in ``hybrid_adam={...}`` is
refused rather than silently preferring one. ``args.max_grad_norm <= 0`` (or ``None``) means
no clipping, as in Trainer. ``weight_decay`` is the decay group's: Trainer builds the groups
(:meth:`transformers.Trainer.get_decay_parameter_names`, no decay for biases and norms).
"""

from __future__ import annotations

import math
from typing import Any

# the optimizer names whose update HybridAdam reproduces (torch's AdamW, fused or not)
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")
# HybridAdam arguments that Trainer's arguments set (Note [trainer owns the hyper-parameters])
OWNED = {"params": "the Trainer's decay / no-decay groups",
         "lr": "learning_rate", "betas": "adam_beta1 / adam_beta2", "eps": "adam_epsilon",
         "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm",
         "grad_accumulation_steps": "gradient_accumulation_steps",
         "adamw": "optim (AdamW: always decoupled)"}


def check_options(hybrid_adam: Any) -> dict | None:
    """The HybridAdam options a user gave the trainer: ``None``/``True`` (defaults), ``False``
    (keep Trainer's optimizer) or a dict of HybridAdam keyword arguments.

    Returns:
        the keyword arguments, or ``None`` for no HybridAdam.

    Raises:
        TypeError: not a bool or a dict with string keys.
        ValueError: a key that the TrainingArguments own, naming the argument to set instead.
    """
    if hybrid_adam is False:
        return None
    if hybrid_adam is None or hybrid_adam is True:
        return {}
    if not isinstance(hybrid_adam, dict) or not all(isinstance(k, str) for k in hybrid_adam):
        raise TypeError(f"hybrid_adam must be a dict of HybridAdam keyword arguments (e.g. "
                        f"{{'offload_fraction': 1.0, 'state_tier': 'cpu'}}), True or False, got "
                        f"{type(hybrid_adam).__name__}")
    for key in hybrid_adam:
        if key in OWNED:
            raise ValueError(f"hybrid_adam[{key!r}] is set by the TrainingArguments "
                             f"({OWNED[key]}): set it there and drop it from hybrid_adam")
    return dict(hybrid_adam)


def clip_norm(args: Any) -> float | None:
    """HybridAdam's ``max_grad_norm`` for these TrainingArguments (``None``: no clipping).

    Raises:
        ValueError: ``args.max_grad_norm`` is not finite.
    """
    value = getattr(args, "max_grad_norm", None)
    if value is None or float(value) <= 0.0:
        return None
    if not math.isfinite(float(value)):
        raise ValueError(f"TrainingArguments.max_grad_norm={value!r} must be finite (or 0 for no "
                         f"clipping)")
    return float(value)


def hybrid_adam_kwargs(args: Any, options: dict) -> dict:
    """HybridAdam's keyword arguments (all but the params) from the TrainingArguments ``args``
    and the user's ``options`` (Note [trainer owns the hyper-parameters]); its accumulation
    boundary is Trainer's (Note [trainer accumulation] in tiermem/integrations/hf.py).

    Raises:
        ValueError: see :func:`clip_norm`.
    """
    return dict(options, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon, weight_decay=args.weight_decay, adamw=True,
                max_grad_norm=clip_norm(args),
                grad_accumulation_steps=args.gradient_accumulation_steps)


def check_optimizer(opt: Any, args: Any) -> None:
    """A HybridAdam the user built (``Trainer(optimizers=(opt, None))``) must clip and
    accumulate as the TrainingArguments say.

    Raises:
        ValueError: ``max_grad_norm`` or ``grad_accumulation_steps`` disagree, naming both.
    """
    want = clip_norm(args)
    if opt.max_grad_norm != want:
        raise ValueError(f"HybridAdam(max_grad_norm={opt.max_grad_norm}) but "
                         f"TrainingArguments.max_grad_norm={args.max_grad_norm}: the trainer "
                         f"clips inside HybridAdam only; build it with max_grad_norm={want}")
    if opt.grad_accumulation_steps != args.gradient_accumulation_steps:
        raise ValueError(f"HybridAdam(grad_accumulation_steps={opt.grad_accumulation_steps}) but "
                         f"TrainingArguments.gradient_accumulation_steps="
                         f"{args.gradient_accumulation_steps}: build it with "
                         f"grad_accumulation_steps={args.gradient_accumulation_steps}")


def refusal(trainer: Any, hybrid: bool, offload: bool) -> str | None:
    """Why this trainer cannot run tiermem's integration, or ``None`` if it can.

    ``hybrid``: HybridAdam replaces the optimizer; ``offload``: activation offload is on.

    Raises:
        Nothing.
    """
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return ("DeepSpeed is enabled (TrainingArguments.deepspeed): DeepSpeed builds its own "
                "optimizer and offload; drop deepspeed to use tiermem, or drop tiermem")
    if getattr(trainer, "is_fsdp_enabled", False):
        return ("FSDP is enabled (TrainingArguments.fsdp): the tiermem trainer runs one "
                "process; drop fsdp (HybridAdam steps FSDP2 shards in a plain loop)")
    if getattr(args, "world_size", 1) > 1:
        return (f"world_size={args.world_size}: the tiermem trainer runs one process (Trainer "
                f"would wrap the model in DDP); run one process, or use "
                f"HybridAdam(data_parallel=True) in a plain loop")
    if offload and getattr(args, "activation_offloading", False):
        return ("activation_offloading=True in the trainer's config (TRL's offloader) and "
                "activation_offload (tiermem's): two saved-tensor offloaders would nest; keep "
                "one")
    ckpt_kwargs = getattr(args, "activation_checkpointing_kwargs", None) or {}
    if offload and isinstance(ckpt_kwargs, dict) and ckpt_kwargs.get("offload"):
        return ("activation_checkpointing_kwargs={'offload': True} (transformers' save_on_cpu) "
                "and activation_offload (tiermem's) would nest; keep one")
    if not hybrid:
        return None
    if getattr(args, "fp16", False):
        return ("fp16=True: Trainer's GradScaler unscales gradients in place after backward, "
                "where HybridAdam's overlap has taken them, and the tiermem trainer steps "
                "HybridAdam without it; use bf16=True (HybridAdam takes a torch.amp.GradScaler "
                "in a plain loop, with overlap=False or max_grad_norm: Note [grad scaler])")
    optim = getattr(args.optim, "value", args.optim)
    if optim not in ADAMW_NAMES:
        return (f"TrainingArguments.optim={optim!r} but hybrid_adam replaces the optimizer "
                f"with AdamW; set optim to one of {ADAMW_NAMES}, or pass hybrid_adam=False")
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        return ("optimizer_cls_and_kwargs is given and hybrid_adam replaces the optimizer; "
                "give HybridAdam's options as hybrid_adam={...} instead")
    return None
