"""A transformers model's config as the planner's shape: ``tiermem plan --hf-config``.

Note [hf config shape]: the config is a local ``config.json``, a directory holding one, or a
hub model name already in the local Hugging Face cache (nothing is downloaded: ``tiermem plan``
runs offline). The parameter count is exact: the model is built from the config on the meta
device (no memory), tied weights counted once. ``n_layers``, ``d_model``, ``n_heads`` and
``vocab`` are ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads`` and
``vocab_size``; ``seq`` is ``max_position_embeddings`` capped at 2048 (the planner's default:
a training sequence, not the longest the model accepts; ``--seq`` overrides). The planner's
activation model is a GELU MLP that saves ``2 x mlp_ratio x d_model`` per token; a gated MLP
(Llama's ``gate_proj``/``up_proj``) saves four tensors of ``intermediate_size`` (gate, up,
activation, product), so ``mlp_ratio = ceil(2 x intermediate / d_model)`` for a gated MLP and
``ceil(intermediate / d_model)`` for a plain one. Mixtures of experts are refused (give the
MoE flags instead).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tiermem.shapes import ModelShape

SEQ_CAP = 2048
"""Tokens per sequence taken from ``max_position_embeddings`` at most (Note [hf config shape])."""

_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class HFShape:
    """A config's planner shape (``mlp_ratio`` as Note [hf config shape] says), its exact
    parameter count and where it came from."""

    shape: ModelShape
    num_params: int
    source: str


def _load(spec: str):
    """The transformers config for a path or a cached hub name.

    Raises:
        ValueError: neither a config nor a cached hub model, naming ``spec`` and the fix.
    """
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ValueError("--hf-config needs transformers: pip install 'tiermem[hf]'") from exc
    path = os.path.expanduser(spec)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--hf-config {spec!r}: the directory has no config.json; give a "
                         f"config.json or a model directory")
    try:
        if os.path.isfile(path):
            return AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)) if
                                              os.path.basename(path) == "config.json" else path)
        if os.path.isdir(path):
            return AutoConfig.from_pretrained(path)
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        where = ("it is not a local file or directory, and the hub model is not in the local "
                 "Hugging Face cache (tiermem plan does not download: run `hf download "
                 f"{spec} config.json` first, or give the path of a config.json)")
        if os.path.exists(path):
            where = f"transformers cannot read it ({str(exc).splitlines()[0]})"
        raise ValueError(f"--hf-config {spec!r}: {where}") from None


def _count(config) -> tuple[int, bool]:
    """Parameters of the model built from ``config`` on the meta device, and whether its MLP
    is gated."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM head for this architecture
            model = AutoModel.from_config(config)
    names = [n for n, _ in model.named_parameters()]
    gated = any("gate_proj" in n or "gate_up_proj" in n for n in names)
    return sum(p.numel() for p in model.parameters()), gated


def hf_shape(spec: str) -> HFShape:
    """The planner's shape and parameter count of a transformers config (Note [hf config
    shape]).

    Args:
        spec: a ``config.json``, a directory with one, or a hub model name in the local cache.

    Raises:
        ValueError: the config cannot be found or read, lacks a field the planner needs, or is
            a mixture of experts; each names the field or value and the fix.
    """
    config = _load(spec)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _MOE_KEYS:
        if getattr(cfg, key, None):
            raise ValueError(f"--hf-config {spec!r}: {key}={getattr(cfg, key)}: a mixture of "
                             f"experts; give --layers, --d-model, --experts, --top-k and "
                             f"--d-expert instead")
    fields = {}
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        value = getattr(cfg, name, None)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--hf-config {spec!r}: {name}={value!r} is not a positive int "
                             f"(model_type {cfg.model_type!r}); give --params, --layers and "
                             f"--d-model instead")
        fields[name] = value
    n_params, gated = _count(config)
    d_model = fields["hidden_size"]
    inter = getattr(cfg, "intermediate_size", None) or 4 * d_model
    ratio = max(1, math.ceil((2 if gated else 1) * inter / d_model))
    seq = min(getattr(cfg, "max_position_embeddings", None) or SEQ_CAP, SEQ_CAP)
    shape = ModelShape(fields["num_hidden_layers"], d_model, fields["num_attention_heads"],
                       vocab=fields["vocab_size"], seq_len=seq, mlp_ratio=ratio)
    return HFShape(shape, n_params, f"{cfg.model_type} config {spec}")
