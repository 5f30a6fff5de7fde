"""Checks of what :func:`tiermem.stream.stream_weights` is given: one clear error per bad input
(naming the block, the parameter, the value and the fix), before anything is changed."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Sequence

import torch
from torch import nn

from tiermem.names import check_int, parse_bytes, short_repr

STREAM_TIERS = ("cpu", "nvme")

# every module whose weights a live WeightStream streams, to refuse streaming it twice
STREAMED_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def block_params(blocks: Sequence[nn.Module]) -> list[list[tuple[str, nn.Parameter]]]:
    """Each block's ``(name, parameter)`` pairs, checked: no meta weights, no parameter shared
    by two blocks (tied weights) or aliasing another one's memory, no block streamed already.

    Raises:
        TypeError: ``blocks`` empty or holding something that is not an ``nn.Module``.
        ValueError: a block given twice, a parameter on the meta device, a parameter (or its
            memory) shared across blocks or aliased within one, a block streamed already.
    """
    who = "stream_weights: "
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"{who}blocks must be an nn.ModuleList (or a sequence) of blocks, got "
                        f"one {type(blocks).__name__}; pass e.g. model.blocks")
    blocks = list(blocks)
    if not blocks:
        raise ValueError(f"{who}blocks is empty; pass the nn.ModuleList of blocks to stream")
    seen_blocks: dict[int, int] = {}
    owner: dict[int, tuple[int, str]] = {}      # id(param) -> (block, name)
    memory: dict[tuple, tuple[int, str]] = {}   # (device, storage address) -> (block, name)
    out = []
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise TypeError(f"{who}blocks[{i}] is a {type(block).__name__}, not an nn.Module")
        if id(block) in seen_blocks:
            raise ValueError(f"{who}blocks[{i}] is the same module as blocks"
                             f"[{seen_blocks[id(block)]}] (a block run twice per pass); stream "
                             f"distinct blocks only")
        seen_blocks[id(block)] = i
        other = STREAMED_BLOCKS.get(block)
        if other is not None:
            raise ValueError(f"{who}blocks[{i}] is streamed already by another WeightStream; "
                             f"close() that one first")
        pairs = list(block.named_parameters())
        for name, p in pairs:
            if type(p.data).__name__ == "DTensor" or type(block).__name__.startswith("FSDP"):
                raise ValueError(f"{who}blocks[{i}].{name} is sharded (a DTensor: FSDP2's "
                                 f"fully_shard or tensor parallel); weight streaming moves "
                                 f"whole parameters and does not compose with FSDP2: stream an "
                                 f"unsharded model on one process")
            if p.is_meta:
                raise ValueError(f"{who}blocks[{i}].{name} is on the meta device (no data to "
                                 f"stream); materialize the model first (module.to_empty("
                                 f"device=...) and initialize it)")
            if id(p) in owner:
                j, other_name = owner[id(p)]
                raise ValueError(f"{who}blocks[{i}].{name} is the same parameter as blocks[{j}]"
                                 f".{other_name} (tied weights across blocks); weight streaming "
                                 f"keeps one copy per block: untie them or keep these blocks "
                                 f"out of the stream")
            owner[id(p)] = (i, name)
            if p.numel():
                where = (str(p.device), p.untyped_storage().data_ptr())
                if where in memory:
                    j, other_name = memory[where]
                    raise ValueError(f"{who}blocks[{i}].{name} shares its memory with blocks"
                                     f"[{j}].{other_name} (views of one buffer); weight streaming "
                                     f"moves each parameter on its own: give each its own "
                                     f"storage (p.data = p.data.clone())")
                memory[where] = (i, name)
        out.append(pairs)
    return out


def check_options(store: Any, tier: Any, prefetch_blocks: Any, gpu_bytes: Any,
                  resident: Any, n_blocks: int) -> tuple[int | None, tuple[int, ...] | None]:
    """Check the options; return ``gpu_bytes`` in bytes (or None) and ``resident`` as a sorted
    tuple (or None).

    Raises:
        TypeError: a store that is not a TierStore, a non-int depth or index.
        ValueError: an unknown tier, ``"nvme"`` on a store without an nvme tier, a closed
            store, a negative depth, both ``gpu_bytes`` and ``resident``, an index out of range.
    """
    from tiermem.store import TierStore  # noqa: PLC0415  (keeps this module light)

    who = "stream_weights: "
    if not isinstance(store, TierStore):
        raise TypeError(f"{who}store must be a tiermem.TierStore, got {type(store).__name__}")
    if store.closed:
        raise ValueError(f"{who}store is closed; pass an open TierStore")
    if tier not in STREAM_TIERS:
        raise ValueError(f"{who}tier={short_repr(tier)} is unknown; use 'cpu' (pinned RAM) or "
                         f"'nvme' (spill files behind a RAM staging area)")
    if tier == "nvme" and store.config.nvme_bytes == 0:
        raise ValueError(f"{who}tier='nvme' needs a store with an nvme tier "
                         f"(StoreConfig.nvme_bytes=0); set nvme_bytes and nvme_dir, or use "
                         f"tier='cpu'")
    check_int(who, "prefetch_blocks", prefetch_blocks, low=0, unit="blocks",
              fix="give 0 (fetch each block when it runs), 1 or 2")
    if gpu_bytes is not None and resident is not None:
        raise ValueError(f"{who}give gpu_bytes (a budget: the last blocks that fit stay "
                         f"resident) or resident (block indices), not both")
    if gpu_bytes is not None:
        gpu_bytes = parse_bytes(gpu_bytes, "stream_weights gpu_bytes")
    if resident is None:
        return gpu_bytes, None
    if isinstance(resident, (str, bytes)) or not hasattr(resident, "__iter__"):
        raise TypeError(f"{who}resident must be a sequence of block indices, got "
                        f"{type(resident).__name__}")
    out = set()
    for k in resident:
        check_int(who, "resident[...]", k, low=0, unit="block index")
        if k >= n_blocks:
            raise ValueError(f"{who}resident holds block {k}, but there are {n_blocks} blocks; "
                             f"give indices 0 to {n_blocks - 1}")
        out.add(k)
    return None, tuple(sorted(out))


def unpinned_warning(store: Any) -> str | None:
    """The warning for a store on a CUDA device whose host memory is not pinned (Note [pinned
    host copies]), or None.

    Note [pinned host copies]: a host-to-device copy from pageable memory is synchronous to
    the host (CUDA's API synchronization notes: ``cudaMemcpyAsync`` returns once the bytes are
    staged through a pinned bounce buffer, which for a block of weights means once the copy,
    ordered after the compute stream's work queued before the fill, has largely run). The host
    then cannot queue the running block's kernels while the next block is being copied, and
    the stream's copies serialize with the compute they should hide behind. Every H2D copy of
    a stream reads the store's cpu pool (the host copies with ``tier="cpu"``, the NVMe staging
    with ``"nvme"``), pinned on CUDA unless ``StoreConfig.pin_memory=False``; the host
    gradients the D2H copies write are pinned by the stream itself (Note [host gradients]).

    Raises:
        nothing.
    """
    if store.device.type == "cuda" and store.config.pin_memory is False:
        return ("weight streaming: the store's host memory is not pinned "
                "(StoreConfig.pin_memory=False) on a CUDA device: every weight copy to the GPU "
                "is synchronous and cannot overlap compute (Note [pinned host copies]); set "
                "pin_memory='auto' or True")
    return None


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor a streamed parameter's ``.data`` is while its block is not on the
    device during a pass (any use of it fails on its shape instead of reading freed memory).

    Raises:
        nothing.
    """
    return torch.empty(0, dtype=dtype, device=device)


def select_frozen(per_block: list[list[tuple[str, nn.Parameter]]], frozen_only: Any
                  ) -> list[list[tuple[str, nn.Parameter]]]:
    """The pairs to stream: all of them, or with ``frozen_only`` the weights that do not
    require grad (a frozen base; LoRA adapters stay ordinary parameters).

    Raises:
        TypeError: ``frozen_only`` not a bool.
    """
    if not isinstance(frozen_only, bool):
        raise TypeError(f"stream_weights: frozen_only={short_repr(frozen_only)} must be a bool "
                        f"(True: stream only the weights with requires_grad=False)")
    if not frozen_only:
        return per_block
    return [[(n, p) for n, p in pairs if not p.requires_grad] for pairs in per_block]


def check_grad_flags(entries: Sequence[Any], hooked: set[int]) -> None:
    """Refuse a streamed weight made trainable after ``stream_weights``: the stream hooks the
    gradients of the weights that required grad when it began, and another weight's gradient
    would be left on the device and lost.

    Raises:
        ValueError: naming the weight and the fix.
    """
    for p in entries:
        if p.param.requires_grad and id(p.param) not in hooked:
            raise ValueError(
                f"weight streaming: blocks[{p.block.index}].{p.name} requires grad now but was "
                f"frozen when stream_weights() began (its gradient would be lost); close() the "
                f"stream and stream again after changing requires_grad")


def check_host_grads(entries: Sequence[Any]) -> None:
    """Refuse a streamed weight whose ``.grad`` is not a host tensor like its weight (or None):
    at a pass start, and when its backward takes the gradients (Note [gradients at backward]).

    Raises:
        ValueError: naming the weight, the gradient's dtype, shape and device, and the rule.
    """
    for p in entries:
        grad = p.param.grad
        if grad is not None and (grad.device.type != "cpu" or grad.shape != p.host.shape
                                 or grad.dtype != p.host.dtype):
            raise ValueError(
                f"weight streaming: blocks[{p.block.index}].{p.name}.grad is a "
                f"{grad.dtype} tensor of shape {tuple(grad.shape)} on {grad.device}; "
                f"between passes a streamed parameter's gradient is a host tensor like "
                f"its weight ({p.host.dtype}, {tuple(p.host.shape)}, cpu), or None")


def replaced(p: Any) -> bool:
    """Whether streamed weight ``p``'s ``param.data`` was replaced between passes (Note [param
    changes]): it is no longer its host copy.

    Raises:
        ValueError: the new data has another shape or dtype.
    """
    data = p.param.data
    if data.data_ptr() == p.host.data_ptr() and data.shape == p.host.shape:
        return False
    if data.shape != p.host.shape or data.dtype != p.host.dtype:
        raise ValueError(
            f"weight streaming: blocks[{p.block.index}].{p.name}.data was replaced "
            f"by a {data.dtype} tensor of shape {tuple(data.shape)}; a streamed "
            f"weight keeps its {p.host.dtype} shape {tuple(p.host.shape)}: copy new "
            f"values in (param.data.copy_(new)); change a dtype (module.to(dtype)) "
            f"before stream_weights or after close()")
    return True


def check_composition(modules: Sequence[nn.Module], blocks: Sequence[Any]) -> None:
    """At each pass start, refuse what a stream does not compose with (docs/streaming.md,
    "What it refuses"): a streamed parameter replaced after ``stream_weights`` (FSDP2's
    ``fully_shard`` swaps in sharded parameters), a forward inside DistributedDataParallel,
    ``offload_activations(offload_weights=True)`` over streamed blocks.

    Raises:
        RuntimeError: one line naming the wrapper or option and the fix.
    """
    for module, block in zip(modules, blocks):
        for p in block.params:
            try:
                now = module.get_parameter(p.name)
            except AttributeError:
                now = None
            if now is not p.param:
                what = "gone" if now is None else f"a new {type(now.data).__name__} parameter"
                fsdp = type(module).__name__.startswith("FSDP") or type(now.data).__name__ \
                    == "DTensor"
                raise RuntimeError(
                    f"weight streaming: blocks[{block.index}].{p.name} is no longer the "
                    f"parameter stream_weights() streams ({what}"
                    + (", swapped in by FSDP2's fully_shard" if fsdp else "")
                    + "); FSDP2/FSDP shard parameters a stream moves whole: weight streaming "
                      "does not compose with them: train on one process with the stream, or "
                      "close() it before wrapping")
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    if ddp is not None and ddp.DistributedDataParallel._get_active_ddp_module() is not None:
        raise RuntimeError(
            "weight streaming: streamed blocks run inside a DistributedDataParallel forward; "
            "DDP all-reduces gradients on the device that a stream takes to the host, so data "
            "parallel with weight streaming is not supported: train on one process, or keep "
            "these blocks out of stream_weights()")
    from tiermem.offload.context import active_offloader  # noqa: PLC0415  (light)

    off = active_offloader()
    if off is not None and off.policy.offload_weights:
        ours = {id(m) for m, b in zip(modules, blocks) if b.streamed}
        hit = [i for i, m in enumerate(off.blocks)
               if id(m) in ours and off.policy.offloads_layer(i)]
        if hit:
            raise RuntimeError(
                f"weight streaming: offload_activations(offload_weights=True) covers streamed "
                f"block {hit[0]} of its blocks; the stream frees and refetches those weights "
                f"already (offloading them too copies each twice more): pass "
                f"offload_weights=False")
