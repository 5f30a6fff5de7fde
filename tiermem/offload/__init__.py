"""Activation offload: saved tensors of chosen layers go to pinned RAM or NVMe, back in reverse.

``from tiermem.offload import offload_activations``; see :mod:`tiermem.offload.activations`.
"""

from tiermem.offload.activations import (
    ActivationOffloader,
    LayerPolicy,
    default_store_config,
    offload_activations,
    resolve_layers,
)

__all__ = ["offload_activations", "ActivationOffloader", "LayerPolicy", "default_store_config",
           "resolve_layers"]
