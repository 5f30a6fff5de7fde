"""Model-building helpers for large runs: meta-device construction and layer-by-layer init."""

from tiermem.models.init import materialize_

__all__ = ["materialize_"]
