"""Optimizers: the native CPU Adam kernel and HybridAdam (state on GPU, pinned RAM or NVMe)."""

from tiermem.optim.cpu_adam import adam_step_, native_available
from tiermem.optim.hybrid_adam import HybridAdam

__all__ = ["HybridAdam", "adam_step_", "native_available"]
