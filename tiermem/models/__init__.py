"""Model-building helpers for large runs (meta-device construction and layer-by-layer init), the
reference GPT (:mod:`tiermem.models.gpt`) and a small mixture-of-experts transformer."""

from tiermem.models.gpt import GPT, GPTConfig
from tiermem.models.init import materialize_
from tiermem.models.moe import MoE, MoEConfig

__all__ = ["GPT", "GPTConfig", "MoE", "MoEConfig", "materialize_"]
