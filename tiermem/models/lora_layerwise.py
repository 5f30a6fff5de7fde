"""A peft LoRA Llama whose frozen base is built one decoder layer at a time, straight into a
weight stream's NVMe home (Note [layer-wise NVMe base] in tiermem/stream/nvme_home.py): the
70B-shaped base of issue 29's LoRA row, which neither RAM nor the GPU can hold whole.

Note [layer-wise LoRA Llama]: :func:`layerwise_lora_llama` builds the ``LlamaForCausalLM`` on
the meta device, then makes real, on ``device``, what stays resident: the embeddings, the final
norm, the LM head (``normal(0, 0.02)`` / ones, from a generator seeded by ``seed``) and the
rotary tables (built anew there). Every decoder layer's base weight becomes a stand-in
(:func:`tiermem.stream.nvme_home.stand_in`: its shape and dtype, no memory), peft wraps the
model (adapters seeded by ``seed``: ``lora_A`` Kaiming-uniform, ``lora_B`` zeros, fp32 for a
bf16 base) and the adapters move to ``device``. The returned ``layer_weights(i)`` makes layer
``i``'s base weights on ``device`` (RMSNorm weights ones, every projection ``normal(0, 0.02)``
from a generator seeded by ``(seed, i)``): ``stream_lora_base(..., load_block=layer_weights)``
writes each to NVMe as it is made. ``materialize=True`` fills every layer at once instead (the
same weights, for the run without streaming to compare with). The weights are not those of
:func:`tiermem.models.lora_llama.lora_llama` for the same seed (another initialisation order).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tiermem.models.lora_llama import (LlamaShape, _imports, _llama_config, _with_lora,
                                       decoder_layers, set_checkpointing)
from tiermem.stream.nvme_home import stand_in

STD = 0.02
"""The projections' and embeddings' initial standard deviation (transformers' default)."""


def layerwise_lora_llama(shape: LlamaShape, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, rank: int = 8, alpha: int = 16,
                         max_seq: int = 4096, checkpoint: bool = False, seed: int = 0,
                         materialize: bool = False
                         ) -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """The LoRA Llama of ``shape`` with its decoder layers' base weights as stand-ins, and the
    function that makes one layer's (Note [layer-wise LoRA Llama]).

    Args:
        shape, dtype, rank, alpha, max_seq, checkpoint: as :func:`~tiermem.models.lora_llama.
            lora_llama`.
        device: where the resident parts and the layers made by ``layer_weights`` live.
        seed: seeds every weight (resident parts, adapters, each layer).
        materialize: fill every layer now (no stand-in left): the unstreamed model.

    Returns:
        ``(model, layer_weights)``: the ``PeftModel`` and ``layer_weights(i)`` -> layer ``i``'s
        base weights by parameter name (as in ``decoder_layers(model)[i]``), on ``device``.

    Raises:
        ImportError: transformers or peft is missing.
        ValueError: ``rank`` < 1.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"layerwise_lora_llama: rank={rank!r} must be an int >= 1")
    device = torch.device(device)
    AutoModelForCausalLM = _imports()[2]
    config = _llama_config(shape, max_seq)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module, init in ((base.model.embed_tokens, "normal"), (base.model.norm, "ones"),
                         (base.lm_head, "normal")):
        module.to_empty(device=device)
        with torch.no_grad():
            if init == "ones":
                module.weight.fill_(1.0)
            else:
                module.weight.normal_(0.0, STD, generator=gen)
    with torch.device(device):
        base.model.rotary_emb = type(base.model.rotary_emb)(config=config)
    for layer in base.model.layers:
        for module in layer.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(stand_in(p), requires_grad=False)
    torch.manual_seed(seed)  # peft's adapter initialisation
    model = _with_lora(base, rank, alpha)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(device)
    if checkpoint:
        set_checkpointing(model, True)
    model.train()
    layers = decoder_layers(model)

    def layer_weights(i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s base weights by parameter name, made on ``device`` in the base's
        dtype (Note [layer-wise LoRA Llama]).

        Raises:
            IndexError: ``i`` is not a decoder layer's index.
        """
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 7919 * (i + 1))
        out = {}
        for name, p in layers[i].named_parameters():
            if p.requires_grad:
                continue
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if name.endswith("layernorm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, STD, generator=g)
            out[name] = t
        return out

    if materialize:
        for i, layer in enumerate(layers):
            weights = layer_weights(i)
            for name, p in layer.named_parameters():
                if name in weights:
                    p.data = weights[name]
    return model, layer_weights
