"""Checks of what :func:`tiermem.stream.stream_weights` is given: one clear error per bad input
(naming the block, the parameter, the value and the fix), before anything is changed."""

from __future__ import annotations

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


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor a streamed parameter's ``.data`` is while its block is not on the
    device during a pass (any use of it fails on its shape instead of reading freed memory).

    Raises:
        nothing.
    """
    return torch.empty(0, dtype=dtype, device=device)
