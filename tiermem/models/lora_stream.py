"""Weight streaming of a LoRA model's frozen base (issue 29: LoRA at 32B-70B on one GPU).

:func:`stream_lora_base` streams the frozen weights of every decoder layer of a peft LoRA
Llama (:func:`tiermem.models.lora_llama.lora_llama`) through a TierStore of its own sized to
them: ``stream_weights(decoder_layers(model), frozen_only=True)``, so the base lives in the
store's pinned RAM (``tier="cpu"``) or on NVMe (``tier="nvme"``) and reaches the GPU one layer
at a time, prefetched ``prefetch_blocks`` ahead; the adapters stay ordinary resident
parameters, stepped by whatever optimizer the caller built (HybridAdam or torch AdamW), and the
base gets no gradient and no optimizer state. The embeddings, the final norm and the LM head
stay resident. examples/train_lora.py caps the process's GPU memory with
:func:`tiermem.gpu_cap.cap_gpu`, as examples/train_large.py does, after the stream has moved
the base off the GPU.

Note [LoRA stream schedule]: a transformers Llama runs its own forward, so each step is one
depth-first pass: every streamed layer crosses PCIe once in the forward and once more for its
backward (with checkpointing the backward's recomputation runs while the layer is on the GPU:
no third copy). tiermem's block-major loop (each block once per pass whatever the number of
micro-batches) drives tiermem's GPT blocks only, so ``schedule="block-major"`` is refused here;
at one micro-batch per step the two schedules move the same bytes.

Note [LoRA stream on NVMe]: with ``tier="nvme"`` the base's only home is NVMe
(``stream_weights(..., staging_blocks=k)``, Note [NVMe home] in tiermem/stream/nvme_home.py):
no RAM copy of it, each layer read from its NVMe file ahead of use (forward order, then the
backward's reverse) into at most ``k`` layers of pinned RAM staging (default
``prefetch_blocks + 2``) and evicted again once its copy to the GPU has landed. The store's RAM
budget is those ``k`` layers plus one pool slab of slack, whatever the base's size, so a base
larger than RAM streams (its NVMe budget is the base plus one slab). Before this, the nvme
tier kept a RAM host copy of every streamed weight beside its NVMe copy (the base's full size
in RAM *and* on disk).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tiermem.config import StoreConfig
from tiermem.models.lora_llama import decoder_layers
from tiermem.options import STREAM_SCHEDULES, STREAM_TIERS
from tiermem.store import TierStore
from tiermem.stream import WeightStream, stream_weights
from tiermem.stream.nvme_home import staging_bytes

logger = logging.getLogger("tiermem")

_SLAB_BYTES = 1 << 30
"""Pinned-pool slab of the stream's store (bytes): a 32B layer's largest weight is 283 MB."""


def base_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the decoder layers' frozen weights, bytes of the largest layer's), the
    weights :func:`stream_lora_base` streams."""
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad)
             for layer in decoder_layers(model)]
    return sum(sizes), max(sizes, default=0)


def check_stream_options(*, tier: str = "cpu", prefetch_blocks: int = 1,
                         schedule: str = "depth-first", nvme_dir: str | None = None,
                         staging_blocks: int | None = None) -> None:
    """Refuse options the LoRA stream cannot run with, one line naming the flag and the fix.

    Raises:
        ValueError: an unknown ``tier`` or ``schedule``, ``schedule="block-major"`` (Note [LoRA
            stream schedule]), ``prefetch_blocks`` not an int >= 0, ``tier="nvme"`` without
            ``nvme_dir``, ``staging_blocks`` not an int >= 1 or given with ``tier="cpu"``.
    """
    if tier not in STREAM_TIERS:
        raise ValueError(f"--stream-tier={tier!r} is not one of {', '.join(STREAM_TIERS)}")
    if schedule not in STREAM_SCHEDULES:
        raise ValueError(f"--stream-schedule={schedule!r} is not one of "
                         f"{', '.join(STREAM_SCHEDULES)}")
    if schedule == "block-major":
        raise ValueError("--stream-schedule=block-major drives tiermem's GPT blocks "
                         "(examples/train_large.py), not a transformers Llama's forward; fix: "
                         "--stream-schedule depth-first (Note [LoRA stream schedule])")
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) \
            or prefetch_blocks < 0:
        raise ValueError(f"--prefetch-blocks={prefetch_blocks!r} must be an int >= 0 (layers "
                         f"fetched ahead of the running one), e.g. 1")
    if tier == "nvme" and not nvme_dir:
        raise ValueError("--stream-tier=nvme needs --nvme-dir DIR (the store's spill "
                         "directory); fix: add --nvme-dir or use --stream-tier cpu")
    if staging_blocks is None:
        return
    if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) \
            or staging_blocks < 1:
        raise ValueError(f"--staging-blocks={staging_blocks!r} must be an int >= 1 (layers of "
                         f"the NVMe base staged in RAM), e.g. {prefetch_blocks + 2}")
    if tier != "nvme":
        raise ValueError(f"--staging-blocks={staging_blocks} bounds the RAM staging of a base "
                         f"on NVMe; fix: add --stream-tier nvme, or drop --staging-blocks")


def stream_lora_base(model: nn.Module, *, device: torch.device | str, tier: str = "cpu",
                     prefetch_blocks: int = 1, schedule: str = "depth-first",
                     nvme_dir: str | None = None, staging_blocks: int | None = None,
                     load_block=None) -> tuple[WeightStream, TierStore]:
    """Stream the frozen weights of ``model``'s decoder layers through a new store.

    The store holds exactly what it streams: its pinned-RAM budget is the base's bytes plus one
    slab (``tier="cpu"``), or (``tier="nvme"``, Note [LoRA stream on NVMe]) the staging of
    ``staging_blocks`` layers plus one slab beside an NVMe budget of the base plus one slab;
    slabs are taken as the weights go in.

    Args:
        model: a peft LoRA Llama (:func:`~tiermem.models.lora_llama.lora_llama`), base frozen,
            on ``device`` or on the CPU.
        device: the compute device (the store's device).
        tier, prefetch_blocks, nvme_dir: ``stream_weights``'s tier and prefetch (layers), the
            spill directory for ``"nvme"``.
        schedule: ``"depth-first"`` (Note [LoRA stream schedule]).
        staging_blocks: ``tier="nvme"``: layers staged in RAM at once (None: ``prefetch_blocks
            + 2``; Note [NVMe home]).
        load_block: ``tier="nvme"``: the ``layer_weights`` of :func:`~tiermem.models.
            lora_layerwise.layerwise_lora_llama`, whose layers are built one at a time
            straight into NVMe (Note [layer-wise NVMe base]).

    Returns:
        (the :class:`~tiermem.stream.WeightStream`, its store); close the stream, then the
        store.

    Raises:
        ValueError: the options of :func:`check_stream_options`, or no frozen weight in the
            decoder layers (nothing to stream).
        the errors of :func:`~tiermem.stream.stream_weights` (nothing is streamed then).
    """
    check_stream_options(tier=tier, prefetch_blocks=prefetch_blocks, schedule=schedule,
                         nvme_dir=nvme_dir, staging_blocks=staging_blocks)
    total, largest = base_bytes(model)
    if total == 0:
        raise ValueError("stream_lora_base: the decoder layers have no frozen weight to stream; "
                         "pass the peft LoRA model (its base frozen)")
    slab = min(_SLAB_BYTES, max(1 << 20, largest))
    if tier == "cpu":
        cfg = StoreConfig(device=str(device), gpu_bytes=0, cpu_bytes=total + slab, nvme_bytes=0,
                          pool_slab_bytes=slab)
    else:
        if staging_blocks is None:
            staging_blocks = prefetch_blocks + 2
        cfg = StoreConfig(device=str(device), gpu_bytes=0,
                          cpu_bytes=staging_ram_bytes(model, staging_blocks) + slab,
                          nvme_bytes=total + slab, nvme_dir=nvme_dir, pool_slab_bytes=slab)
    store = TierStore(cfg)
    try:
        stream = stream_weights(decoder_layers(model), store=store, tier=tier,
                                prefetch_blocks=prefetch_blocks, frozen_only=True,
                                staging_blocks=staging_blocks if tier == "nvme" else None,
                                load_block=load_block)
    except BaseException:
        store.close()
        raise
    logger.info("LoRA base streamed from %s: %d bytes in %d layers, prefetch %d%s", tier, total,
                len(decoder_layers(model)), prefetch_blocks,
                f", {staging_blocks} layers of RAM staging" if tier == "nvme" else "")
    return stream, store


def staging_ram_bytes(model: nn.Module, staging_blocks: int) -> int:
    """RAM the NVMe base's staging of ``staging_blocks`` layers may hold (bytes; Note [NVMe
    home]); the store's budget adds one pool slab to it.

    Raises:
        nothing: arithmetic on the model's sizes.
    """
    return staging_bytes([[p.numel() * p.element_size() for p in layer.parameters()
                           if not p.requires_grad] for layer in decoder_layers(model)],
                         staging_blocks)


def stream_summary(st: dict, steps: int) -> str:
    """One line from a stream's ``stats()`` after ``steps`` steps: its H2D bytes (1e9) and
    fills per step (what the step's PCIe floor is) and its peak layers on the device.

    Raises:
        KeyError: ``st`` is not a :meth:`WeightStream.stats` dict.
    """
    return (f"stream: {st['h2d_bytes'] / max(steps, 1) / 1e9:.2f} GB H2D in "
            f"{st['fills'] / max(steps, 1):.0f} layer fills per step, peak "
            f"{st['peak_blocks']} layers on the device"
            + (f", RAM staging peak {st['staging_peak_bytes'] / 1e9:.3f} GB in "
               f"{st['staging_peak_blocks']} layers (the base's only RAM)"
               if "staging_peak_bytes" in st else ""))
