"""Checksums of the parameters HybridAdam wrote: a change through ``param.data`` is taken into the
masters like a version-counter change (Note [param checksums]).

Note [param checksums]: ``param.data`` is a new tensor on the parameter's storage with a version
counter of its own, so ``p.data.mul_(0.9)`` or ``p.data.copy_(ema)`` (EMA swaps, manual decay,
re-init code) leaves ``p._version`` and ``data_ptr`` as they were and the watch of Note [param
changes] saw nothing: with the state offloaded (or a bf16 param's fp32 master on the GPU side)
the next step stepped the old master and wrote it over the change, which was used for one step
and then silently reverted; torch.optim.AdamW continues from it. Only the bytes tell, so
:class:`ParamSums` keeps the checksum (``tiermem.stream.checksums.checksum``: exact integer
words, Note [streamed weight checksums] says what it cannot catch) of every watched parameter's
storage as HybridAdam left it: taken for all of them when the masters are set from the params
(state allocated or loaded) and, for those written since, when the next step begins (in
``_finish_step``, after the worker is done and the caller's stream waits for the H2D copies, so
on CUDA the sums are issued on that stream behind every write-back and go to pinned memory
behind an event, no host sync). A write by HybridAdam (:meth:`ParamWatch.writing`) voids the
parameter's sum until then. At the first hand-over of a step (a gradient hook with overlap, else
``step()``) the sums of all watched parameters are taken again and compared with those, in one
batch; a parameter whose bytes moved while its version did not is taken into its masters exactly
as a version-counter change (:meth:`ParamWatch.sync`: the same ``_refresh``, so the result is
bit-identical to ``with torch.no_grad(): p.mul_(0.9)``), logged once per optimizer at INFO.
On CUDA that comparison waits once per step on the batch's event (the GPU has to reach the
first hand-over: with overlap, the first gradient of the backward); never once per parameter.
The baselines' events are long done when they are read (at that comparison, or at the next
step's begin). ``state_dict()`` compares each parameter alone (a wait per parameter there, off
the training path). On the CPU the same path runs synchronously. Cost on CUDA: two reads of the
watched params per step (the sums after the write-back and at the first hand-over; ~0.7 ms each
for 1.3B bf16 params at ~4 TB/s) and a few small kernels per param. Not seen: a ``.data``
change made after the first hand-over of a step (during the backward, or between a gradient
hook and ``step()``: only version-counter changes are refused there), with
``param_sync="forward"`` one made before ``opt.synchronize()`` (the step's completion takes the
sums, so they include it; Note [param changes] asks for ``synchronize()`` first), a change
whose words cancel modulo 2**64 (a permutation of whole 8-byte words) and several processes
(the watch is off there). Streamed weights are watched too, through their host copies, with the
sums at the comparison taken from the stream where it has them: Note [streamed write-back
checksums]. A false alarm (a sum taken while an aborted step's write was still landing, or a
streamed weight's in-place write of a step that failed) changes nothing: the parameter holds
its master as written (rounded), which the refresh keeps.

Note [streamed write-back checksums]: a streamed weight (Note [streamed write-back]) is stepped
through its host copy, which is its ``.data`` between passes, so ``p.data.mul_(0.9)`` between
steps writes the host copy; the stream streams it to the next forward (Note [streamed weight
checksums]) and HybridAdam takes it into the weight's masters (chunks and, below
``offload_fraction=1``, its GPU-side share, which lives on the host) at the same point and
through the same :meth:`ParamWatch.sync` and ``_refresh`` as an unstreamed parameter's, so the
run is bit-identical to the unstreamed one with the same write (before, the master was stepped
from before the write and written back over it: the change lasted one step). The two sums:
- *As HybridAdam left it*: due when the next step begins (``_finish_step``, after the worker
  is done) for the streamed weights stepped since their last sum (the worker's kernel writes a
  host copy in place, outside :meth:`ParamWatch.writing`, so their step counts tell) and those
  written inside ``writing()``. The stream cannot give it (its fills come before the
  write-back), so each piece of a host copy is summed as it is written, on the worker's thread
  (:meth:`ParamWatch.pieces_written`; ``piece_checksum``'s quantity: each byte weighted by its
  place in the weight's 8-byte words, so the pieces add up to the whole's checksum, exactly):
  a piece stepped in place (Note [in-place host chunks]) by the native kernel itself, which
  adds up each 2048-element block of its output right after writing it, from L1
  (``adam_step_unchecked(sum_as=...)``, tm_adam_step_sum in native/adam.c; no second pass over
  the host copy: that re-read cost the 24-block reference GPT 0.11-0.15 s of ``write_back_s``
  per step on the H200 host); a piece written from the param-out ring (or stepped in place by
  torch's fallback kernel) by ``piece_checksum`` right after the write, a re-read of what was
  just written. A weight whose pieces written this step tile it exactly takes their total.
  The rest is read on the host then (synchronous, no device sync): a weight with a GPU-side share
  (``offload_fraction < 1``) or a piece the GPU lane stepped, a host copy not 8-byte aligned;
  a piece a rollback restored is rewritten by its re-step, whose sum replaces the first.
- *Now*, at the comparison (the first hand-over of the step): when a pass is open, the sum of
  the weight at its block's first fill in that pass (``WeightStream.host_sum``), which the
  stream takes at every fill anyway (Note [streamed weight checksums]) and keeps on the host
  (on CUDA a pinned copy issued on the copy stream behind an event that is only queried, never
  waited for): the bytes of the host copy then (``tier="nvme"``: of the store copy, rewritten
  from the host copy at the pass start). With ``overlap=True`` and no ``max_grad_norm`` the
  first hand-over is a gradient of the step's last backward pass. Otherwise the host copy is
  read then: a comparison in ``step()`` (``overlap=False``, clipping, the first step), a block
  the open pass has not filled, a sum not yet landed (CUDA), a host copy not 8-byte aligned
  (the device buffer's word grid).
So with ``overlap=True``, no clipping and ``offload_fraction=1``, from the second step on no
host copy is read for the watch but by the worker, once, as it writes it; the caller's thread
reads none and waits for no device. ``ParamSums.stats`` counts each kind (``known_sums`` /
``read_sums`` at the comparison, ``known_bases`` / ``read_bases`` after the write-back;
tests/stream/test_stream_inplace.py::test_the_streamed_sums_are_not_read_again).
Caught: a ``.data`` write between ``step()`` and the step's first hand-over, at the tiers
``cpu`` and ``nvme``, at any ``offload_fraction``, with accumulation (between micro-batches
too), clipping, block-major passes, ``param_sync="forward"`` once the step is complete (the
same limits as above); tests/stream/test_stream_inplace.py::
test_streamed_masters_take_a_data_write_as_unstreamed. Not seen, beyond the limits above: a
write during the open pass into a block's host copy after its first fill (through a reference
kept from between passes; a refill refuses it: Note [streamed weight checksums]), whose master
keeps the value from before it.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

import torch

from tiermem._log import logger
from tiermem.stream.checksums import MASK_64, checksum, sums_to_host

Key = Hashable


class ParamSums:
    """The checksum of each watched parameter's storage as HybridAdam last left it, and the
    comparison with its bytes now (Note [param checksums]). Not thread-safe: the caller
    (:class:`ParamWatch`) serialises every call under its lock.

    Args:
        who: the optimizer's name, for the log line.
    """

    def __init__(self, who: str) -> None:
        self._who = who
        self._gen: dict[Key, int] = {}  # bumped by every HybridAdam write: voids older sums
        self._base: dict[Key, tuple[int, int]] = {}  # key -> (gen, sum), landed on the host
        self._inflight: list[tuple[list[Key], list[int], torch.Tensor, Any]] = []
        self._moved: set[Key] | None = None  # this step's comparison, made at first use
        self._logged = False
        # sums compared (known from a stream's fill, or read now) and taken after a write
        # (known: summed by the worker as it wrote, or read)
        # (Note [streamed write-back checksums])
        self.stats = {"known_sums": 0, "read_sums": 0, "known_bases": 0, "read_bases": 0}

    def written(self, keys: Iterable[Key]) -> None:
        """HybridAdam wrote these parameters: their sums are void until retaken.

        Raises:
            Nothing.
        """
        for key in keys:
            self._gen[key] = self._gen.get(key, 0) + 1

    def take(self, tensors: dict[Key, torch.Tensor], only_void: bool,
             known: dict[Key, int] | None = None) -> None:
        """Take the sums of ``tensors`` (key -> the parameter's flat storage view) after
        HybridAdam's writes to them were issued on the current stream; with ``only_void``, of
        those whose sum is void or missing. On CUDA the sums land behind an event. ``known``:
        sums of some of them summed by their writer (Note [streamed write-back checksums]),
        taken as they are instead of reading those tensors.

        Raises:
            Nothing beyond torch's errors.
        """
        self._moved = None  # a new step: compare again at its first hand-over
        tensors = {k: t for k, t in tensors.items() if not (only_void and self._valid(k))}
        for key, s in (known or {}).items():
            if key in tensors:
                del tensors[key]
                self._base[key] = (self._gen.get(key, 0), s)
                self.stats["known_bases"] += 1
        self.stats["read_bases"] += len(tensors)
        for keys, ts in _by_device(tensors):
            gens = [self._gen.get(k, 0) for k in keys]
            host, event = _sums(ts)
            self._inflight.append((keys, gens, host, event))

    def moved(self, key: Key, storages: Callable[[], dict[Key, torch.Tensor]],
              batch: bool) -> bool:
        """Whether ``key``'s bytes differ from its sum (an untracked change); ``storages``
        gives every watched key's flat storage (called once per comparison); with ``batch``
        all of them are compared once per step (the first call) and the answer kept,
        else ``key`` alone now. The sums compared become the new ones. Logs the first change.

        Raises:
            Nothing beyond torch's errors.
        """
        if batch:
            if self._moved is None:
                self._moved = self._compare(storages())
            found = key in self._moved
        else:
            tensors = storages()
            found = key in tensors and key in self._compare({key: tensors[key]})
        if found and not self._logged:
            self._logged = True
            logger.info("%s: param %s was changed through a tensor autograd does not track "
                        "(param.data) since the optimizer wrote it; its masters take the new "
                        "values like a change under torch.no_grad() (Note [param checksums]; "
                        "further such changes are not logged)", self._who, key)
        return found

    def _valid(self, key: Key) -> bool:
        self._land()
        base = self._base.get(key)
        return base is not None and base[0] == self._gen.get(key, 0)

    def _land(self) -> None:
        """Move the sums in flight to ``_base`` (their events are long done when called)."""
        for keys, gens, host, event in self._inflight:
            if event is not None:
                event.synchronize()  # the host reads the sums next
            for key, gen, s in zip(keys, gens, host.tolist()):
                if gen == self._gen.get(key, 0):
                    self._base[key] = (gen, s)
        self._inflight = []

    def _compare(self, tensors: dict[Key, torch.Tensor | int]) -> set[Key]:
        """The keys of ``tensors`` with a valid sum that differs from their bytes now (an int:
        their sum now, known without a read: Note [streamed write-back checksums]); every
        compared sum is replaced by the one now (the caller's refresh leaves the param)."""
        self._land()
        valid = {k: t for k, t in tensors.items() if self._valid(k)}
        now = {k: t for k, t in valid.items() if isinstance(t, int)}
        self.stats["known_sums"] += len(now)
        for keys, ts in _by_device({k: t for k, t in valid.items() if k not in now}):
            host, event = _sums(ts)
            if event is not None:
                event.synchronize()  # once per step: the host compares the sums next
            now.update(zip(keys, host.tolist()))
            self.stats["read_sums"] += len(keys)
        moved = set()
        for key, s in now.items():
            if (s - self._base[key][1]) & MASK_64:  # mod 2**64: int64 from torch, or not
                moved.add(key)
            self._base[key] = (self._base[key][0], s)
        return moved


def _by_device(tensors: dict[Key, torch.Tensor]) -> list[tuple[list[Key], list[torch.Tensor]]]:
    groups: dict[torch.device, tuple[list, list]] = {}
    for key, t in tensors.items():
        keys, ts = groups.setdefault(t.device, ([], []))
        keys.append(key)
        ts.append(t)
    return list(groups.values())


def _sums(ts: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """The checksums of ``ts`` (one device) as an int64 host tensor and, on CUDA, the event on
    the current stream after which they have landed in it (pinned); None on the CPU."""
    return sums_to_host(torch.stack([checksum(t) for t in ts]))
