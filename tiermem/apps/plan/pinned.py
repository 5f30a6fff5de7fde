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
weight's gradient as :func:`pinned_bytes` of its bytes. The store's own pool is not counted
here: it pins whole slabs (``StoreConfig.pool_slab_bytes``) and its tensors are its pages.
tests/test_plan_pinned.py compares the row with the host gradients a CPU run allocates.
"""

from __future__ import annotations


def pinned_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator pins for a request of ``nbytes``: the next
    power of two (Note [pinned rounding]); 0 for 0.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"pinned_bytes(): nbytes={nbytes} is negative; fix: a byte count >= 0")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


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
