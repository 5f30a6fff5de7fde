"""Activation offload: saved tensors of chosen layers go to pinned RAM or NVMe, back in reverse.

``from tiermem.offload import offload_activations``; see :mod:`tiermem.offload.activations`.
Tensor-level offload (a region of code, or marked tensors): :mod:`tiermem.offload.tensors`.
"""

from tiermem.offload.activations import (
    ActivationOffloader,
    LayerPolicy,
    default_store_config,
    offload_activations,
    resolve_layers,
)
from tiermem.offload.tensors import (ModuleRegions, TensorOffloader, mark_for_offload,
                                     offload_in_modules, offload_tensors)

__all__ = ["offload_activations", "ActivationOffloader", "LayerPolicy", "default_store_config",
           "resolve_layers", "offload_tensors", "mark_for_offload", "TensorOffloader",
           "offload_in_modules", "ModuleRegions"]
