"""The machine: its capacities and its rates, one model for the planner, the tuner and
``examples/train_large.py``'s predictions.

:class:`MachineRates` holds every rate in bytes/s, params/s, FLOP/s or seconds (no GB/s: a
command converts its GB/s flags at its boundary). Its defaults are the H200 machine's, one run
each (logs in ``docs/results``); :meth:`MachineRates.measure` measures the links, the disk and
the CPU Adam of this machine instead (with the probes' spread, :class:`MeasuredRates`), which
is what ``tiermem tune``'s cost model (:class:`tiermem.apps.tune.cost.CostModel`) predicts from.
The capacities (:data:`H200_GPU_BYTES`, ...) are the defaults :func:`tiermem.apps.plan.plan` checks
a placement against.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass

import torch

from tiermem import options
from tiermem.names import check_number, resolve_device
from tiermem.shapes import GB, GiB, PRESETS
from tiermem.schedule.layers import best_time_s, copy_bandwidths, disk_bandwidths

H200_GPU_BYTES = options.H200_GPU_BYTES  # budgets.gpu_bytes, plan's default
H200_HOST_BYTES = options.H200_HOST_BYTES  # budgets.host_bytes
H200_NVME_BYTES = options.H200_NVME_BYTES  # budgets.nvme_bytes


REFERENCE_TOKENS = 8 * 2048
"""Tokens of the reference forward + backward: the 1.34B GPT (``PRESETS["1b"]``) at
micro-batch 8 x 2048."""
REFERENCE_FWD_BWD_S = 0.2518
"""Seconds of that forward + backward on the H200: ``docs/results/bench_activations.log``,
"no offload: 251.8 ms/step" (bf16, no checkpointing; median of 3 runs' medians, one call)."""
H200_GPU_FLOPS = 6 * PRESETS["1b"].num_params() * REFERENCE_TOKENS / REFERENCE_FWD_BWD_S
"""The H200's effective rate, 6·N·tokens per second of forward + backward, from the reference
run: 6 x 1,343,868,928 x 16,384 / 0.2518 s = 524.7e12 (attention's own FLOPs and every
overhead are folded into it, as they were in that run)."""
REFERENCE_CHECKPOINTED_S = 0.3095
"""Seconds of the reference forward + backward with every block checkpointed on the H200: the
same log, "checkpoint every block: 309.5 ms/step"."""
H200_GPU_FLOPS_CHECKPOINTED = (8 * PRESETS["1b"].num_params() * REFERENCE_TOKENS
                               / REFERENCE_CHECKPOINTED_S)
"""The same with checkpointing, counted as 8·N·tokens (the forward twice): 569.2e12. The
recomputed forward runs faster per FLOP than the first (it saves nothing), so the 6·N rate
scaled by 8/6 would put the reference at 336 ms; the large checkpointed models ran faster still
(20B: 8.80 s where this rate predicts 9.38 s; 13B: 7.17 s against 7.44 s; docs/sizing.md)."""


@dataclass(frozen=True)
class MachineRates:
    """The machine's rates the time per step is predicted from (:func:`step_time`).

    The defaults are the H200 machine's, one run each (logs in ``docs/results``); pass your
    own (``tiermem bench transfer|adam|io|activations`` measure them) to predict another
    machine, or :meth:`measure` the links, the disk and the CPU Adam here. Every rate is a
    positive finite number (``worker_s_per_chunk``, a time, may be 0). One unit per kind:
    bytes/s, params/s, FLOP/s, seconds; ``tiermem plan`` and ``tiermem tune`` convert their
    GB/s at their command line and in what they print.

    Attributes:
        gpu_flops: effective forward + backward rate as ``6·N·tokens`` per second (FLOP/s).
        gpu_flops_checkpointed: the same with every block checkpointed, as ``8·N·tokens``.
        pcie_h2d_bytes_per_s, pcie_d2h_bytes_per_s: pinned copies one direction at a time.
        pcie_both_bytes_per_s: both directions at once, the sum of the two.
        cpu_adam_params_per_s: the CPU Adam kernel with fp32 moments (params/s).
        cpu_adam_bf16_moments_params_per_s: the same with bf16 moments.
        nvme_read_bytes_per_s, nvme_write_bytes_per_s: the spill files' read and write rates.
        worker_s_per_chunk: HybridAdam's chunk worker's seconds per offloaded chunk besides the
            Adam kernel (store get and release, copy issue, events, the GPU lane's hand-off):
            one thread does them between kernels, so they add to the CPU Adam time.

    Raises:
        ValueError: a rate that is not positive or not finite (naming the field);
        TypeError: a rate that is not a number.
    """

    gpu_flops: float = H200_GPU_FLOPS
    gpu_flops_checkpointed: float = H200_GPU_FLOPS_CHECKPOINTED
    # bench_transfer.log, "raw GB/s" column (HybridAdam's rings copy with plain pinned copy_):
    pcie_h2d_bytes_per_s: float = 54.56e9   # "H2D (host -> device) 54.56"
    pcie_d2h_bytes_per_s: float = 54.48e9   # "D2H (device -> host) 54.48"
    pcie_both_bytes_per_s: float = 92.52e9  # "both directions at once 92.52"
    # bench_adam.log, 16 threads: "native mixed" (bf16 params and grads, fp32 master and
    # moments: what HybridAdam runs for a bf16 model) 3.830 G params/s; "native mixed, bf16
    # moments" 4.968 G params/s
    cpu_adam_params_per_s: float = 3.830e9
    cpu_adam_bf16_moments_params_per_s: float = 4.968e9
    # bench_io.log, "SpillSpace posix 4 threads" (the store's default io_threads=4 and
    # io_backend): "write 2.08 GB/s, read 1.74 GB/s"
    nvme_read_bytes_per_s: float = 1.74e9
    nvme_write_bytes_per_s: float = 2.08e9
    # large_20b_ram.log (3,593 chunks of 4M): "optimizer step wall 4.516 s" less "CPU Adam
    # (kernel, summed) 2.790 s", per chunk; the archived chunk-size run agrees (f=1 at 16k
    # tokens: 16M chunks instead of 4M, 240 chunks fewer, 103 ms less: 0.43 ms a chunk)
    worker_s_per_chunk: float = (4.516 - 2.790) / 3593

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            time = f.name == "worker_s_per_chunk"  # a time: 0 counts no worker time
            check_number("MachineRates: ", f.name, getattr(self, f.name), low=0,
                         low_open=not time, high=math.inf, high_open=True,
                         fix="a time is a finite number of seconds >= 0" if time else
                         "a rate is a positive finite number per second")

    @classmethod
    def measure(cls, device: str | torch.device = "auto", nbytes: int = 32 << 20,
                nvme_dir: str | None = None, adam_params: int = 1 << 20, probes: int = 3,
                base: "MachineRates | None" = None,
                who: str = "MachineRates.measure") -> "MeasuredRates":
        """Measure this machine's :data:`MEASURED` rates with small copies, spill-file writes
        and reads, and CPU Adam calls; the other rates are ``base``'s.

        Args:
            device: the compute device (``"auto"``: CUDA if present). Without CUDA, H2D/D2H
                are host copies.
            nbytes: bytes per copy and per spill write/read.
            nvme_dir: directory for the spill timing (None: a temporary directory; it may be a
                RAM disk, so pass the real spill directory for real numbers).
            adam_params: parameters of the CPU Adam timing (fp32 moments).
            probes: independent measurements of every rate; the median is the rate, the
                slowest and fastest are its range.
            base: the rates not measured (GPU, PCIe both ways at once, bf16-moment CPU Adam,
                the chunk worker's time); None: the H200 machine's.
            who: the caller's name for error messages.

        Returns:
            :class:`MeasuredRates`: the rates, and per measured field its ``(slowest,
            fastest)`` probe (empty with one probe).

        Raises:
            ValueError: ``probes`` < 1.
            OSError: ``nvme_dir`` is not writable.
        """
        from tiermem.optim.cpu_adam import adam_step_  # loads the native kernel

        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
            raise ValueError(f"{who}: probes={probes!r} must be an int >= 1")
        device = resolve_device(device, f"{who} device")
        p, g, m, v = (torch.rand(adam_params) for _ in range(4))
        steps = itertools.count(1)
        seen: dict[str, list[float]] = {n: [] for n in MEASURED}
        for _ in range(probes):
            d2h, h2d = copy_bandwidths(device, nbytes)
            write, read = disk_bandwidths(nvme_dir, nbytes)
            adam = adam_params / best_time_s(lambda: adam_step_(
                p, g, m, v, step=next(steps), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0), repeat=3)
            for name, rate in zip(MEASURED, (h2d, d2h, read, write, adam)):
                seen[name].append(rate)
        rates = dataclasses.replace(base or cls(),
                                    **{n: statistics.median(seen[n]) for n in MEASURED})
        ranges = {n: (min(seen[n]), max(seen[n])) for n in MEASURED} if probes > 1 else {}
        return MeasuredRates(rates, ranges)


MEASURED = ("pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s", "nvme_read_bytes_per_s",
            "nvme_write_bytes_per_s", "cpu_adam_params_per_s")
"""The :class:`MachineRates` fields :meth:`MachineRates.measure` measures (bytes/s, params/s)."""


@dataclass(frozen=True)
class MeasuredRates:
    """What :meth:`MachineRates.measure` returns.

    Attributes:
        rates: the probes' medians (the fields not in :data:`MEASURED`: the base's).
        ranges: per measured field, the ``(slowest, fastest)`` probe in the field's unit
            (empty: one probe, no spread known).
    """

    rates: MachineRates
    ranges: dict[str, tuple[float, float]]
