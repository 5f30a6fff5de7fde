"""Splitting a parameter group between the GPU and the offloaded (CPU/NVMe) side.

Pure bookkeeping, no tensors: testable anywhere. Parameters are laid out in execution order
(the order given, normally forward order). The GPU keeps the first ``1 - offload_fraction`` of
the group's bytes: the first layers, whose gradients arrive last in backward, so the CPU can
work on the later layers' chunks while backward is still running. The split is at element
granularity (one tensor may be split in two), so the fraction is met to within one element.
The offloaded elements form one flat buffer cut into chunks of ``chunk_numel`` elements; each
chunk is the unit of the CPU step and of NVMe streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's flattened elements.

    ``param``: index of the parameter in its group; ``start``: first element in the parameter;
    ``numel``: elements; ``flat_offset``: first element in the offloaded flat buffer (GPU pieces:
    unused, -1).
    """

    param: int
    start: int
    numel: int
    flat_offset: int = -1


@dataclass(frozen=True)
class Chunk:
    """Elements ``[flat_start, flat_start + numel)`` of the offloaded flat buffer."""

    index: int
    flat_start: int
    numel: int
    pieces: tuple[Piece, ...]


@dataclass
class GroupPlan:
    """Where each element of a parameter group lives."""

    gpu_pieces: list[Piece] = field(default_factory=list)
    cpu_pieces: list[Piece] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    cpu_numel: int = 0
    gpu_numel: int = 0
    chunks_of_param: dict[int, list[int]] = field(default_factory=dict)


def auto_chunk_numel(offloaded_numel: int) -> int:
    """HybridAdam's default ``chunk_numel``: ``offloaded_numel / 32`` rounded down to a power of
    two, within [2^16, 2^24] elements (large enough that per-chunk costs vanish, small enough
    that the CPU step overlaps backward)."""
    target = max(1, offloaded_numel // 32)
    return min(1 << 24, max(1 << 16, 1 << (target.bit_length() - 1)))


def plan_group(numels: list[int], element_bytes: list[int], offload_fraction: float,
               chunk_numel: int, order: list[int] | None = None) -> GroupPlan:
    """Split a group's parameters between GPU and offloaded side, and chunk the offloaded side.

    Args:
        numels: elements of each parameter.
        element_bytes: bytes per element of each parameter (its model dtype).
        offload_fraction: fraction of the group's bytes to offload, in [0, 1].
        chunk_numel: elements per offloaded chunk (> 0).
        order: the parameters' indices in execution order (``None``: as given). Pieces keep
            the parameters' own indices; chunks follow this order.

    Raises:
        ValueError: lengths differ, fraction outside [0, 1], chunk_numel < 1, ``order`` not a
            permutation of the indices.
    """
    if len(numels) != len(element_bytes):
        raise ValueError("numels and element_bytes must have the same length")
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"offload_fraction={offload_fraction} is outside [0.0, 1.0]")
    if chunk_numel < 1:
        raise ValueError(f"chunk_numel={chunk_numel} must be >= 1")
    if order is None:
        order = list(range(len(numels)))
    elif sorted(order) != list(range(len(numels))):
        raise ValueError(f"order={order} is not a permutation of 0..{len(numels) - 1}")
    total_bytes = sum(n * b for n, b in zip(numels, element_bytes))
    gpu_bytes_left = round((1.0 - offload_fraction) * total_bytes)
    plan = GroupPlan()
    flat = 0
    for i in order:
        n, b = numels[i], element_bytes[i]
        keep = min(n, -(-gpu_bytes_left // b)) if gpu_bytes_left > 0 else 0
        gpu_bytes_left -= keep * b
        if keep:
            plan.gpu_pieces.append(Piece(i, 0, keep))
            plan.gpu_numel += keep
        if n - keep:
            plan.cpu_pieces.append(Piece(i, keep, n - keep, flat))
            flat += n - keep
    plan.cpu_numel = flat
    for c, chunk_start in enumerate(range(0, flat, chunk_numel)):
        chunk_end = min(flat, chunk_start + chunk_numel)
        pieces = []
        for p in plan.cpu_pieces:
            lo, hi = max(p.flat_offset, chunk_start), min(p.flat_offset + p.numel, chunk_end)
            if lo < hi:
                pieces.append(Piece(p.param, p.start + lo - p.flat_offset, hi - lo, lo))
                plan.chunks_of_param.setdefault(p.param, []).append(c)
        plan.chunks.append(Chunk(c, chunk_start, chunk_end - chunk_start, tuple(pieces)))
    return plan
