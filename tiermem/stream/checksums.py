"""Checksums of streamed weights: a change behind autograd's back (``param.data.mul_(...)``) is
streamed between passes and refused during one (Note [streamed weight checksums]).

Note [streamed weight checksums]: ``param.data`` is a new tensor on the parameter's storage with
a version counter of its own, so an in-place write through it (``p.data.mul_(0.5)``,
``with torch.no_grad(): p.data.copy_(w)``, peft's adapter merge ``base.weight.data += delta``)
leaves ``param._version`` where it was, and neither data_ptr nor storage identity moves. The
version checks of Note [weight streaming] cannot see it; only the bytes can. Where it lands:

- **Between passes** ``param.data`` is the host copy. With ``tier="cpu"`` every fill reads the
  host copy, so the next forward streams the change, as it would compute with it unstreamed.
  With ``tier="nvme"`` a fill reads the store's copy, rewritten at a pass start only when the
  weight moved by the signs we had (``_version``, a replaced ``.data``, an optimizer step):
  a ``.data`` write after that (after an evaluation pass, between micro-batches, a merge into a
  frozen base) was silently not streamed. Now the checksum of each host copy is taken when its
  store copy is written, and at every pass start a host copy not rewritten is summed again and
  its store copy rewritten when the sums differ (logged). Cost: one read of those host copies
  in RAM per pass, beside the store reads of every fill that the nvme tier makes anyway. With
  HybridAdam connected the write is also taken into the weight's masters, so the next step
  continues from it as unstreamed (before, it was stepped from its master and written over
  after one step): each block's first fill in a pass keeps its sums on the host for that
  (:meth:`BufferChecks.first_fill_sum`, on CUDA behind an event that is only queried), which
  HybridAdam compares with the host copy's sum after its write-back: Note [streamed write-back
  checksums] in tiermem/optim/param_sums.py. "Between passes" is the same on every device:
  ``param.data`` is the host copy (a CPU tensor) after a backward has ended and after a
  forward under ``no_grad``. Not between passes, though it may look so: after a forward that
  recorded a graph, the pass stays open until its backward ends, and when its outputs are
  dropped without a backward, until the next forward's first block, an optimizer's ``step()``
  or ``close()`` ends it (``stream.in_pass`` says so). There ``param.data`` of a released
  block is an empty placeholder, on the CPU as on CUDA: ``p.data.mul_(0.9)`` changes nothing
  and nothing can tell (no bytes, no version: the write is lost), ``p.data.copy_(w)`` raises
  torch's shape error; of a block kept on the device it is the device buffer (next bullet).
- **During a pass** ``param.data`` is the device buffer while the block is ready (else an empty
  placeholder). A write into the buffer is used by the ops after it, and then lost: a released
  block is refilled from the host copy, and the pass end makes the host copy the data again, so
  a forward and its backward (or a kept block's backward and the step) see different weights.
  Each fill takes the checksum of every weight it copied in (on CUDA on the copy stream, after
  the copy and before the fill's event, so it is ordered before any compute reads the block);
  the release of a block that was made ready takes it again on the compute stream (after the
  block's last reader, before its memory is freed) and compares. On the CPU the comparison is
  made at once and a difference raises at that release. On CUDA the two sums go to pinned host
  memory with a non-blocking copy and an event; no host sync is added per block: every later
  release and the pass end look at the finished ones (``event.query()``), and the optimizer's
  pre-step hook and ``close()`` wait for the rest (the backward has finished on the GPU by
  then, in a loop that reads its gradients). The error is one line naming the weight, raised
  with the pass ended (blocks released, host copies restored: the change is discarded, never
  written anywhere; the gradients of the pass are incomplete, zero them) and the stream usable.
  With HybridAdam connected, the gradients handed to it before the error count as a backward
  pass (its next ``step()`` refuses more passes than ``grad_accumulation_steps``) and chunks
  may have been stepped with gradients of the changed weight: restore from a checkpoint, as
  after any backward that fails midway.
- **The host copy during a pass**, written through a reference to ``param.data`` kept from
  between passes: a block refilled later in the pass (its backward) would get other weights
  than its first fill. Every fill after a block's first in a pass is compared with that first
  one (the sums are taken anyway; on CUDA on the copy stream, landed like a release's) and a
  difference is refused like a change on the device (the host copy keeps the write). Not seen:
  such a write to a block that is not refilled in the pass (kept into the backward, or a
  forward-only pass), whose next pass simply streams it, and with ``tier="nvme"`` (the fills
  read the store copy, which the next pass start rewrites). On CUDA such a write races the
  fills' asynchronous copies out of the same pinned memory: it may reach the first fill too.

The checksum is the sum of the weight's bytes read as 64-bit words, modulo 2**64 (a tail of fewer
than 8 bytes is summed byte by byte): integer adds, so no rounding and no dependence on the
reduction order, and no copy (a float sum of bf16 would round, and an int16 view summed into
int64 is cast to a full-size temporary first). It catches every change of a single word and any
change whose word differences do not cancel modulo 2**64 (a scale, a shift, a fill, a copy of
other values, a clamp, noise, a sign flip unless the flipped words balance exactly). It cannot
catch a permutation of whole 8-byte words (swapped rows or heads whose size is a multiple of
8 bytes), other rewrites whose differences cancel exactly, a write into a released block's
empty placeholder (``p.data.mul_`` of 0 elements changes nothing, so the write is lost;
``p.data.copy_(w)`` raises a shape error), or a change of a resident block (an ordinary
parameter, not streamed; HybridAdam's own sums watch those: Note [param checksums]). Cost per
fill and per release: one read of the block's weights on the device (about 1/80 of the copy's
time over PCIe on an H200) and a kernel per weight; per first fill of a block in a pass on
CUDA, a copy of its few sums to pinned host memory and an event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

MASK_64 = (1 << 64) - 1  # checksums are sums modulo 2**64: ints compared after ``& MASK_64``


def checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the contiguous tensor ``t``'s bytes as int64 words, modulo 2**64 (a tail of
    under 8 bytes added byte by byte), a 0-dim int64 tensor on ``t``'s device
    (Note [streamed weight checksums]). A tensor whose storage offset is not a multiple of 8
    bytes has every byte summed singly (weaker), so compare sums of the same storage layout.

    Raises:
        RuntimeError: ``t`` is not contiguous.
    """
    if not t.is_contiguous():
        raise RuntimeError("checksum: the tensor must be contiguous")
    raw = t.reshape(-1).view(torch.uint8)
    words = raw.numel() // 8 * 8 if raw.storage_offset() % 8 == 0 else 0  # else all bytewise
    if words == raw.numel():
        return raw.view(torch.int64).sum()
    tail = raw[words:].sum(dtype=torch.int64)
    return raw[:words].view(torch.int64).sum() + tail if words else tail


def piece_checksum(whole: torch.Tensor, start: int, numel: int) -> int | None:
    """What elements ``[start, start + numel)`` of the contiguous host tensor ``whole`` add to
    :func:`checksum` of ``whole`` (modulo 2**64): the pieces of a partition of ``whole`` add up
    to it, so a writer can sum what it just wrote (Note [streamed write-back checksums]).
    None when ``whole`` does not start on an 8-byte boundary.

    Raises:
        RuntimeError: ``whole`` is not contiguous.
    """
    if not whole.is_contiguous():
        raise RuntimeError("piece_checksum: the tensor must be contiguous")
    raw = whole.reshape(-1).view(torch.uint8)
    if raw.data_ptr() % 8:
        return None
    size = whole.element_size()
    lo, hi = start * size, (start + numel) * size
    return placed_checksum(raw[lo:hi], lo, raw.numel())


def placed_checksum(piece: torch.Tensor, lo: int, whole_bytes: int) -> int:
    """:func:`piece_checksum` of the bytes ``piece`` (a contiguous uint8 host tensor) placed at
    byte offset ``lo`` of an 8-byte-aligned whole of ``whole_bytes`` bytes, wherever ``piece``
    itself lies (the native CPU Adam's fused sum computes the same: tm_adam_step_sum in
    native/adam.c, Note [streamed write-back checksums]).

    Raises:
        Nothing beyond torch's errors.
    """
    hi = lo + piece.numel()
    words = whole_bytes // 8 * 8  # below: 8-byte words, byte k weighs 256**(k % 8); above: 1
    total = 0
    top = min(hi, words)
    if lo < top:
        a = min(-(-lo // 8) * 8, top)
        b = max(top // 8 * 8, a)
        total += sum(v << (8 * (k % 8)) for k, v in enumerate(piece[:a - lo].tolist(), lo))
        if b > a:
            mid = piece[a - lo:b - lo]
            mid = mid if mid.data_ptr() % 8 == 0 else mid.clone()  # int64 words need alignment
            total += int(mid.view(torch.int64).sum())
        total += sum(v << (8 * (k % 8))
                     for k, v in enumerate(piece[b - lo:top - lo].tolist(), b))
    if max(lo, words) < hi:
        total += int(piece[max(lo, words) - lo:].sum(dtype=torch.int64))
    return total & MASK_64


def host_checksum(t: torch.Tensor) -> int:
    """:func:`checksum` of a host tensor, as a Python int.

    Raises:
        RuntimeError: ``t`` is not contiguous.
    """
    return int(checksum(t))


def sums_to_host(sums: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Checksums ``sums`` on the host without a host sync: on CUDA a pinned copy issued on the
    current stream and the event after which it has landed; on the CPU ``sums`` itself and None.

    Raises:
        Nothing beyond torch's errors.
    """
    if not sums.is_cuda:
        return sums, None
    host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
    host.copy_(sums, non_blocking=True)
    return host, torch.cuda.current_stream(sums.device).record_event()  # landed after it


@dataclass(eq=False)
class _Compare:
    block: int
    names: list[str]
    sums: torch.Tensor   # (2, n) int64: row 0 at the (first) fill, row 1 at the release/refill
    event: Any           # CUDA event of the copy into pinned ``sums``; None: known now
    refill: bool         # row 1 is a later fill of the same pass, not a release


def _compare(block: Any, before: torch.Tensor, now: torch.Tensor, refill: bool) -> _Compare:
    """Both rows of sums, on CUDA copied to pinned memory behind an event on the current
    stream."""
    both, event = sums_to_host(torch.stack([before, now]))
    return _Compare(block.index, [p.name for p in block.params], both, event, refill)


class BufferChecks:
    """The checksums of streamed blocks' device buffers, taken at each fill and compared at
    each release (Note [streamed weight checksums]).

    Args:
        cuda: the compute device is a CUDA device (comparisons resolve asynchronously).

    Raises:
        nothing at construction.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._pending: list[_Compare] = []
        self.stats = {"checked_blocks": 0}
        # block index -> its first fill's sums in this pass on the host (pinned on CUDA) and
        # the event after which they have landed (None: known now), which a connected
        # optimizer compares with its write-back's (Note [streamed write-back checksums])
        self._first_host: dict[int, tuple[torch.Tensor, Any]] = {}

    def new_pass(self, blocks: Sequence[Any]) -> None:
        """A pass begins: forget the sums of the last pass's first fills.

        Raises:
            nothing.
        """
        for block in blocks:
            block.first_sums = None
        self._first_host.clear()

    def first_fill_sum(self, block: Any, k: int) -> int | None:
        """The checksum of ``block``'s weight ``k`` at the block's first fill in this pass (the
        bytes of its host copy then), once landed on the host; None when the block was not
        filled in this pass or (CUDA) the sums are still on their way: never waits (Note
        [streamed write-back checksums]).

        Raises:
            nothing.
        """
        got = self._first_host.get(block.index)
        if got is None or (got[1] is not None and not got[1].query()):
            return None
        return int(got[0][k])

    def filled(self, block: Any, views: Sequence[torch.Tensor]) -> None:
        """Take the checksums of ``block``'s weights just copied into ``views`` (on CUDA: call
        on the copy stream, after the copies, before the fill's event); a later fill of the
        block in the same pass is compared with its first (the source must not have changed).

        Raises:
            nothing beyond torch's errors.
        """
        block.sums = torch.stack([checksum(v) for v in views]) if views else None
        if block.sums is None:
            return
        if block.first_sums is None:
            block.first_sums = block.sums
            self._first_host[block.index] = sums_to_host(block.sums)
        else:  # both made on the copy stream, compared there
            self._pending.append(_compare(block, block.first_sums, block.sums,
                                          refill=True))

    def released(self, block: Any, views: Sequence[torch.Tensor]) -> None:
        """Compare ``block``'s weights in ``views`` (about to be freed; on CUDA: call on the
        compute stream after the block's last reader, which waited for the fill's event) with
        their checksums at the fill; :meth:`raise_changed` reports a difference.

        Raises:
            nothing beyond torch's errors.
        """
        sums, block.sums = block.sums, None
        if sums is None:
            return
        if self.cuda:
            sums.record_stream(torch.cuda.current_stream(sums.device))  # made on the copy
            #                                                             stream, read here
        now = torch.stack([checksum(v) for v in views])
        self._pending.append(_compare(block, sums, now, refill=False))
        self.stats["checked_blocks"] += 1

    def raise_changed(self, wait: bool = False) -> None:
        """Look at the comparisons whose sums have landed (``wait``: all of them, blocking the
        host until they have) and raise for the first weight changed during a pass.

        Raises:
            RuntimeError: one line naming the block and weight, the two checksums and the fix.
        """
        keep, found = [], None
        for r in self._pending:
            if r.event is not None:
                if wait:
                    r.event.synchronize()  # the host compares the sums next
                elif not r.event.query():
                    keep.append(r)
                    continue
            if found is None:
                fill, now = r.sums.tolist()
                bad = [k for k, (a, b) in enumerate(zip(fill, now)) if a != b]
                if bad:
                    found = (r, bad[0], fill[bad[0]] & MASK_64, now[bad[0]] & MASK_64)
        self._pending = keep
        if found is None:
            return
        r, k, a, b = found
        what = (f"was filled with other values than earlier in the same pass (checksum {a:016x} "
                f"at its first fill, {b:016x} now): its host copy was written during the pass "
                f"through a tensor autograd does not track, such as a reference to param.data "
                f"kept from between passes, so the forward and the backward would use different "
                f"weights") if r.refill else (
                f"was changed in place on the device during a pass (checksum {a:016x} at its "
                f"fill, {b:016x} at its release), through a tensor autograd does not track such "
                f"as param.data: a streamed block is refilled from its host copy, so the change "
                f"would be lost or half applied")
        kept = "the host copy keeps the new values" if r.refill else "the change discarded"
        raise RuntimeError(
            f"weight streaming: blocks[{r.block}].{r.names[k]} {what}; the pass was ended and "
            f"{kept} (zero the gradients of this pass): change streamed weights between passes "
            f"(after backward: with torch.no_grad(): param.mul_(...) or param.copy_(...), or "
            f"through the optimizer)")
