"""Integrations with training frameworks.

:mod:`tiermem.integrations.hf`: HybridAdam and activation offload through
``transformers.Trainer`` and TRL's trainers (imports transformers and accelerate, so it is not
imported here). :mod:`tiermem.integrations.accelerate`: the same through an Accelerate loop
(``TiermemAccelerator``). :mod:`tiermem.integrations.hf_config`: a transformers config as the
planner's model shape (``tiermem plan --hf-config``). :mod:`tiermem.integrations.layers`: a
transformers model's decoder layers.
"""

from tiermem.integrations.layers import find_decoder_layers

__all__ = ["find_decoder_layers"]
