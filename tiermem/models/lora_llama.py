"""A transformers Llama built from a config, with peft LoRA adapters on a frozen base.

Needs the optional extra ``[lora]`` (``transformers`` and ``peft``; imported when a model is
built, so this module imports without them). ``lora_llama(SHAPES["tiny"], device="cpu")``
builds a ``LlamaForCausalLM`` from a ``LlamaConfig`` (seeded, no weights downloaded) in the
model dtype, wraps it with ``peft.get_peft_model`` (LoRA of rank ``rank`` on every attention
and MLP projection: ``TARGET_MODULES``) and returns the ``PeftModel``: every base weight is
frozen (``requires_grad=False``) and stays where and what it was built as; only the adapters'
``lora_A`` / ``lora_B`` weights train. peft keeps the adapters in fp32 when the base is bf16
(its ``autocast_adapter_dtype``), so the optimizer steps fp32 adapter weights.

Used by examples/train_lora.py, ``tiermem bench lora`` (:mod:`tiermem.apps.bench.lora`) and
tests/test_lora.py; docs/lora.md says what is offloaded where.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections that get adapters: attention (q, k, v, o) and MLP (gate, up, down)."""

INSTALL_HINT = "pip install -e '.[lora]' (transformers and peft)"


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """Shape of the Llama (sizes in elements, counts in layers/heads/tokens)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SHAPES = {
    # every adapter tensor (rank x in, out x rank) a multiple of 16 elements at rank 8: HybridAdam
    # is then bit-identical to torch's fused AdamW on the CPU (README)
    "tiny": LlamaShape(vocab=256, hidden=64, intermediate=176, layers=3, heads=4, kv_heads=2),
    # Llama-2-7B's shape (6.7e9 parameters)
    "7b": LlamaShape(vocab=32000, hidden=4096, intermediate=11008, layers=32, heads=32,
                     kv_heads=32),
    # Qwen2.5-32B's sizes as a Llama (GQA 40/8 heads; Llama has no q/k/v bias, Qwen2.5 has):
    # 32.8e9 parameters, 58.1 GiB of bf16 weights in the 64 decoder layers (0.91 GiB each)
    "32b": LlamaShape(vocab=152064, hidden=5120, intermediate=27648, layers=64, heads=40,
                      kv_heads=8),
    # Llama-3-70B's shape: 70.6e9 parameters, 127.5 GiB of bf16 weights in the 80 layers
    "70b": LlamaShape(vocab=128256, hidden=8192, intermediate=28672, layers=80, heads=64,
                      kv_heads=8),
}
"""Presets by name: ``tiny`` for the CPU and tests, ``7b`` for one H200, ``32b`` and ``70b``
for one H200 with the base streamed (examples/train_lora.py ``--stream-weights``)."""


def _imports():
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as exc:
        raise ImportError(f"lora_llama: {exc.name or 'transformers/peft'} is not installed; "
                          f"{INSTALL_HINT}") from exc
    return LoraConfig, get_peft_model, AutoModelForCausalLM, LlamaConfig


def _llama_config(shape: LlamaShape, max_seq: int):
    """The ``LlamaConfig`` of ``shape``: ``max_seq`` positions (tokens), sdpa attention, no KV
    cache. Raises ImportError as :func:`_imports`."""
    LlamaConfig = _imports()[3]
    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                       intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       max_position_embeddings=max_seq, attn_implementation="sdpa",
                       use_cache=False)


def _with_lora(base: nn.Module, rank: int, alpha: int) -> nn.Module:
    """``base`` wrapped by peft with LoRA adapters of rank ``rank`` and ``alpha`` on every
    ``TARGET_MODULES`` projection (the adapters seeded by torch's global generator). Raises
    ImportError as :func:`_imports`."""
    LoraConfig, get_peft_model = _imports()[:2]
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                      target_modules=list(TARGET_MODULES))
    with warnings.catch_warnings():  # peft asks transformers 5 an API it deprecates: not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated",
                                category=FutureWarning)
        return get_peft_model(base, lora)


def lora_llama(shape: LlamaShape, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, rank: int = 8, alpha: int = 16,
               max_seq: int = 4096, checkpoint: bool = False, seed: int = 0) -> nn.Module:
    """Build the Llama of ``shape`` on ``device`` in ``dtype`` and wrap it with LoRA adapters.

    The same arguments (and seed) build the same weights, so two calls give two independent
    models that start equal. The model is in training mode (dropout is 0: attention and
    adapters).

    Args:
        shape: the sizes (see :data:`SHAPES`).
        device: where the model is built (weights are initialised there).
        dtype: the base weights' dtype (adapters: fp32 when this is bf16 or fp16, else this).
        rank: LoRA rank ``r`` (>= 1).
        alpha: LoRA ``alpha``; the adapter output is scaled by ``alpha / rank``.
        max_seq: longest sequence in tokens (``max_position_embeddings``).
        checkpoint: checkpoint every decoder layer (transformers' activation checkpointing,
            non-reentrant ``torch.utils.checkpoint``).
        seed: ``torch.manual_seed`` for the weights (base and adapters).

    Returns:
        a ``peft.PeftModel``; its decoder layers are ``decoder_layers(model)``.

    Raises:
        ImportError: transformers or peft is missing (the message gives the install command).
        ValueError: ``rank`` < 1, or transformers built another dtype than ``dtype`` (an old
            transformers that ignores ``dtype=``; upgrade it).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_llama: rank={rank!r} must be an int >= 1 (the LoRA rank r)")
    AutoModelForCausalLM = _imports()[2]
    config = _llama_config(shape, max_seq)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    built = next(model.parameters()).dtype
    if built != dtype:
        raise ValueError(f"lora_llama: transformers built {built} weights for dtype={dtype}; "
                         f"upgrade transformers (it must accept from_config(..., dtype=...))")
    model = _with_lora(model, rank, alpha)
    if checkpoint:  # after wrapping: peft's own check calls an API transformers 5 deprecates
        set_checkpointing(model, True)
    model.train()
    return model


def set_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn transformers' activation checkpointing of every decoder layer on or off
    (non-reentrant ``torch.utils.checkpoint``), on a transformers model or a ``PeftModel``.

    Raises:
        TypeError: ``model`` is not a transformers model (nor a PeftModel of one).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "gradient_checkpointing_enable"):
        raise TypeError(f"set_checkpointing: model is a {type(model).__name__}, not a "
                        f"transformers model; pass the LlamaForCausalLM or its PeftModel")
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
        if enabled:
            base.activation_checkpointing_enable({"use_reentrant": False})
        else:
            base.activation_checkpointing_disable()
    elif enabled:
        base.gradient_checkpointing_enable({"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a (peft-wrapped) LlamaForCausalLM, in execution order: the
    blocks to hand to :func:`tiermem.offload.offload_activations`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters (the LoRA adapters' weights), in module order."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """peft's ``lora_A`` / ``lora_B`` Linears (``...q_proj.lora_A.default``), in module order:
    what :func:`tiermem.offload.offload_in_modules` takes to offload the adapters' tensors."""
    return [m for name, m in model.named_modules()
            if name.split(".")[-2:-1] in (["lora_A"], ["lora_B"])]


def frozen_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The frozen base parameters by name (embeddings, projections, norms, LM head)."""
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def lora_batches(vocab: int, batch: int, seq: int, steps: int,
                 device: str | torch.device = "cpu", seed: int = 1000) -> list[torch.Tensor]:
    """``steps`` different ``(batch, seq)`` token-id batches, each a learnable sequence.

    Each sequence starts at a random token and follows ``next = (7 * token + 3) % vocab``, so a
    model can learn to predict it (the loss falls) while every batch is new. Use the ids as
    ``input_ids`` and ``labels`` (the model shifts the labels).

    Raises:
        ValueError: a size < 1.
    """
    for name, value in (("vocab", vocab), ("batch", batch), ("seq", seq), ("steps", steps)):
        if value < 1:
            raise ValueError(f"lora_batches: {name}={value} must be >= 1")
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            ids[:, t] = (7 * ids[:, t - 1] + 3) % vocab
        out.append(ids.to(device))
    return out
