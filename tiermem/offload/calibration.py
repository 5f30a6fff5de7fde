"""``layers="auto"``: the timed forward (Note [timed forward]) and the choice made from it.

:class:`_Calibration` records each block's forward time and saved bytes in one forward;
:func:`copy_rates` measures the copy bandwidths as it starts; :func:`plan_layers` picks, when
the forward after it starts, the blocks whose copies hide behind compute
(:func:`tiermem.schedule.layers.choose_layers`), Note [offload rules], rule 8, in
tiermem/offload/rules.py. Units: seconds, bytes, bytes/s (the plan: ms, GB/s).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from tiermem.offload.rules import LayerPolicy
from tiermem.schedule.layers import (BlockCosts, choose_layers, copy_bandwidths, disk_bandwidths,
                                     kept_budget_bytes, simulate)

_CALIBRATION_FORWARD = 2  # layers="auto" times this forward (the first one warms up)
_TIMING_TRIES = 3  # timed forwards that may end untimed before auto gives up (Note [timed forward])
_BWD_PER_FWD = 2.0  # backward compute of a block, in forwards (its two matmuls per forward one)
_ROOM_FRACTION = 0.8  # share of the device memory left unused that auto may fill with activations


class _Calibration:
    """Per-block forward time and saved bytes of one forward (``layers="auto"``).

    Times come from CUDA events on the compute stream (read once the forward is done), or the
    host clock without CUDA; bytes count each saved storage once per block.

    Note [timed forward]: the timed forward offloads every block but the last (as the first
    does: memory stays bounded while nothing is known), but it offloads each block's saved
    tensors when the block exits, after its end event, instead of in the pack hook: what the
    events bracket is then the block's own kernels, not the host work of its puts (store
    bookkeeping, pinned slots, copy issue) nor any wait a put adds. With the puts in the pack
    hook, the H200 timed the reference GPT's blocks (8 x 2048 tokens, d_model 2048) at a median
    5.1 and 6.8 ms in two runs, while checkpointing's recompute puts a block's forward at ~2.4 ms;
    choose_layers then believed 2-3x more copy time hid behind compute than does and chose 5-8
    blocks: the table row with the chunked loss took 1.24x of no offload. With the puts after
    the end event and the host clock below, the H200 timed a block at 2.99 ms and auto chose 3
    blocks at 0.99x (docs/benchmarks.md, at ee65090). The host seconds of each block, start
    to end hook (``plan["host_ms"]``), and of its deferred puts (``offload_host_s``,
    ``plan["offload_host_ms"]``) are kept too: on CUDA the host only issues the work, and
    choose_layers runs a host clock beside the device's (tiermem/schedule/layers.py), so a
    block whose puts would leave the device waiting for the host is not chosen; on the CPU the
    host computes the blocks, and its clock is the one timed. The peak of the timed forward
    grows by at most one block's saved tensors. A timed forward that ends without timing
    every block (it raised, or did not run them all) is followed by another, up to
    ``_TIMING_TRIES`` in all; after that no choice is made (a warning; all blocks but the
    last stay offloaded). The old code waited for a complete timing that never came: after
    one failed step auto never chose.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.marks: dict[int, list] = {}  # block -> [start, end] (events or perf_counter)
        self.nbytes = [0] * num_blocks
        # per block: data_ptr -> weakref of the storage counted there (an offloaded storage is
        # freed in forward and its address reused, so the pointer alone does not identify it)
        self.storages: list[dict[int, weakref.ref]] = [{} for _ in range(num_blocks)]
        self.bandwidths: tuple[float, float] | None = None  # (d2h, h2d) bytes/s
        # host seconds each block's deferred offloads took at its exit (Note [timed forward])
        self.offload_host_s = [0.0] * num_blocks
        self.host_marks: dict[int, list] = {}  # block -> [host start, host end] (perf_counter)

    def _mark(self, device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))  # times the block's kernels
            return event
        return time.perf_counter()

    def enter(self, index: int, device: torch.device) -> None:
        self.host_marks[index] = [time.perf_counter(), None]
        self.marks[index] = [self._mark(device), None]

    def exit(self, index: int, device: torch.device) -> None:
        if index in self.marks:
            self.marks[index][1] = self._mark(device)
            self.host_marks[index][1] = time.perf_counter()

    def host_seconds(self) -> list[float]:
        """Host seconds from each block's start to its end hook (its Python and launches; the
        deferred puts come after, in ``offload_host_s``)."""
        return [max(0.0, end - start) for start, end in
                (self.host_marks[i] for i in range(self.num_blocks))]

    def saved(self, index: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        seen = self.storages[index].get(storage.data_ptr())
        if seen is None or seen() is not storage:
            self.storages[index][storage.data_ptr()] = weakref.ref(storage)
            self.nbytes[index] += storage.nbytes()

    def complete(self) -> bool:
        return len(self.marks) == self.num_blocks and all(e is not None
                                                          for _, e in self.marks.values())

    def fwd_seconds(self) -> list[float]:
        out = []
        for i in range(self.num_blocks):
            start, end = self.marks[i]
            if isinstance(start, float):
                out.append(max(0.0, end - start))
            else:
                end.synchronize()  # the timed forward ran long ago; this returns at once
                out.append(start.elapsed_time(end) / 1e3)
        return out



def copy_rates(device: torch.device, tier: str, nvme_dir: str | None) -> tuple[float, float]:
    """``(offload, reload)`` bytes/s: PCIe copies, and with ``tier="nvme"`` no faster than
    the spill directory's disk (``nvme_dir``)."""
    d2h, h2d = copy_bandwidths(device, 32 << 20)
    if tier == "nvme":
        write, read = disk_bandwidths(nvme_dir)
        d2h, h2d = min(d2h, write), min(h2d, read)
    return d2h, h2d


def plan_layers(cal: _Calibration, policy: LayerPolicy, device: torch.device,
                max_kept_bytes: int | None) -> tuple[frozenset[int], dict]:
    """``layers="auto"``: the offloaded blocks chosen from the timed forward ``cal`` and the
    plan that says why (the blocks' backward is taken as ``_BWD_PER_FWD`` forwards; the copy
    bandwidths are those measured when the timed forward started); what stays on the device is
    bounded by ``max_kept_bytes``, or on CUDA by ``_ROOM_FRACTION`` of the memory the steps have
    left unused so far. ``policy``: the one the timed forward ran under (its layers were
    offloaded then; its prefetch depth is used)."""
    fwd = cal.fwd_seconds()
    cuda = device.type == "cuda"  # a host clock apart from the device's (Note [timed forward])
    host = cal.host_seconds()
    costs = BlockCosts(tuple(fwd), tuple(_BWD_PER_FWD * f for f in fwd), tuple(cal.nbytes),
                       host_s=tuple(host) if cuda else (),
                       offload_host_s=tuple(cal.offload_host_s) if cuda else ())
    d2h, h2d = cal.bandwidths
    limit = max_kept_bytes
    if limit is None and cuda:  # the timed forward's peak holds only the kept blocks
        limit = kept_budget_bytes(cal.nbytes, policy.layers,
                                  torch.cuda.get_device_properties(device).total_memory,
                                  torch.cuda.max_memory_allocated(device), _ROOM_FRACTION)
    layers = choose_layers(costs, d2h, h2d, policy.prefetch_depth, limit)
    timeline = simulate(costs, layers, d2h, h2d, policy.prefetch_depth)
    plan = {"layers": sorted(layers), "fwd_ms": [1e3 * f for f in fwd],
            "nbytes": list(cal.nbytes), "d2h_gbps": d2h / 1e9, "h2d_gbps": h2d / 1e9,
            "max_kept_bytes": limit, "kept_bytes": timeline.kept_bytes,
            "predicted_stall_ms": 1e3 * (timeline.stall_s + timeline.late_s
                                         + timeline.host_stall_s),
            "host_ms": [1e3 * s for s in host],
            "offload_host_ms": [1e3 * s for s in cal.offload_host_s]}
    return layers, plan
