"""Model-building helpers for large runs (meta-device construction and layer-by-layer init) and
a small mixture-of-experts transformer."""

from tiermem.models.init import materialize_
from tiermem.models.moe import MoE, MoEConfig

__all__ = ["MoE", "MoEConfig", "materialize_"]
