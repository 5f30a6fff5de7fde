"""The host RAM a tensor pinned by torch takes, for the plan's rows of tensors the library pins
one by one outside the store: the host gradients of streamed weights (Note [pinned rounding]).

Note [pinned rounding]: ``torch.empty(..., pin_memory=True)`` goes through torch's caching host
allocator, which rounds every request up to the next power of two (by default:
``pinned_max_round_threshold_mb`` is unset; CachingHostAllocator.h) and pins the rounded size.
The stream pins one host gradient per streamed weight that way (Note [host gradients] in
tiermem/stream/grads.py), and with depth-first accumulation one staging tensor beside each, so
a 13B block's qkv gradient of 150 MiB pins 256 MiB and its 200 MiB fc and out gradients 256
MiB each: the 28 streamed blocks of the 13B stream preset pin 22.8 GiB for 16.4 GiB of
gradients. The plan counted the bytes, 6.4 GiB short of what the H200 run pinned (its 112.8
GiB of peak RSS: the store's 89 GiB of slabs, these 22.8 GiB, and ~1 GiB of process), and only
its 8 GiB host reserve hid it. So the ``"gradients"`` row's host side counts each streamed
weight's gradient as :func:`pinned_bytes` of its bytes. The store's pool rounded the same way:
its slabs, cut to whole blocks (1008 MiB for 48 MiB chunks), each pinned the next power of
two, so the 13B stream preset's 88 GiB store pinned ~89 GiB. It now cuts its pinned slabs as
powers of two and counts them at what they pin, so ``StoreConfig.cpu_bytes`` is what it pins
(Note [slab tail] in tiermem/store/pool.py, where :func:`pinned_bytes` lives: the library's
pool cannot import the plan); the plan counts the chunks those slabs hold with the pool's
:func:`~tiermem.store.pool.pool_blocks`. tests/test_plan_pinned.py compares the gradients row
with the host gradients a CPU run allocates; tests/store/test_pool_pinned.py the pool's cuts.
"""

from __future__ import annotations

from tiermem.optim.layout import chunk_state_bytes, state_numel
from tiermem.store.pool import pinned_bytes, pool_blocks, pool_room

__all__ = ["block_pinned_bytes", "pinned_bytes", "state_in_ram", "state_pool_room"]


def block_pinned_bytes(block_params: int, param_bytes: int, numels: list[int]) -> int:
    """One block's weights' gradients pinned one tensor each (Note [pinned rounding]): the sum
    of :func:`pinned_bytes` over ``numels`` (the block's tensors, ``block_numels``) when they
    add up to ``block_params``; else (a ``num_params`` of another model) an upper bound: twice
    the bytes (rounding up to a power of two never doubles a size).

    Raises:
        nothing: arithmetic on ints.
    """
    if sum(numels) == block_params:
        return sum(pinned_bytes(n * param_bytes) for n in numels)
    return 2 * block_params * param_bytes


def _chunks(offloaded_numel: int, chunk: int) -> tuple[int, int]:
    """``(full chunks, elements of the last partial chunk)`` of ``offloaded_numel`` in chunks
    of ``chunk`` elements."""
    return divmod(offloaded_numel, chunk) if chunk else (0, 0)


def state_pool_room(offloaded_numel: int, chunk: int, moments_dtype, slab_bytes: int) -> int:
    """The store's ``cpu_bytes`` that HybridAdam's offloaded state takes in pinned slabs
    (``state_tier="cpu"``): whole slabs of full chunks, then a slab for the rest (Note [slab
    tail] in tiermem/store/pool.py); the bytes when chunks fill slabs exactly.

    Args:
        offloaded_numel: elements whose state is offloaded.
        chunk: elements of the largest chunk (``largest_chunk``).
        moments_dtype: the moments' torch dtype.
        slab_bytes: the store's ``pool_slab_bytes``.

    Raises:
        nothing: arithmetic on ints.
    """
    full, rest = _chunks(offloaded_numel, chunk)
    room = pool_room(full, chunk_state_bytes(chunk, moments_dtype), slab_bytes)
    return room + (pool_room(1, chunk_state_bytes(rest, moments_dtype), slab_bytes)
                   if rest else 0)


def state_in_ram(room_bytes: int, offloaded_numel: int, chunk: int, moments_dtype,
                 slab_bytes: int) -> int:
    """Bytes of HybridAdam's offloaded state that ``state_tier="split"`` holds in RAM when the
    store's pool has ``room_bytes`` left for it: the whole chunks its pinned slabs hold (Note
    [slab tail] in tiermem/store/pool.py: 21 chunks of 48 MiB in a 1 GiB slab), at most all.

    Raises:
        nothing: arithmetic on ints.
    """
    full, rest = _chunks(offloaded_numel, chunk)
    state = 4 * state_numel(1, moments_dtype) * offloaded_numel
    if room_bytes <= 0 or not full + (rest > 0):
        return 0
    held = pool_blocks(room_bytes, chunk_state_bytes(chunk, moments_dtype), slab_bytes)
    if held < full or (rest and held == full
                       and room_bytes < state_pool_room(offloaded_numel, chunk, moments_dtype,
                                                        slab_bytes)):
        return min(held, full) * 4 * state_numel(chunk, moments_dtype)
    return state
