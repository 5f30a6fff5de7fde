"""The tuner's cost model: bytes per link and CPU Adam work -> predicted step time.

Each link moves its bytes at its bandwidth (H2D, D2H, NVMe read, NVMe write; the two NVMe
directions share the disk), the CPU Adam steps its parameters at its rate, and compute takes
``compute_s``. Serial prediction: the sum of all; overlapped (``overlap=True``): the largest of
compute, H2D, D2H, NVMe and CPU Adam (perfect overlap; a lower bound).

How sure a prediction is: :meth:`CostModel.measure` probes every rate ``probes`` times (3 by
default) and keeps the median, with the slowest and fastest probe in ``CostModel.ranges``; each
prediction then has a range (:meth:`CostModel.predict_range_s`: every rate at its slowest probe,
then at its fastest).

Units: bandwidths in GB/s (1e9 bytes/s), CPU Adam in G params/s (1e9 parameters/s), times in
seconds, sizes in bytes.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tiermem.names import resolve_device
from tiermem.schedule.layers import best_time_s, copy_bandwidths, disk_bandwidths

LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Links of the cost model."""

RATES = ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps", "cpu_adam_gparams")
"""The rates of :class:`CostModel`."""

DISAGREE_FACTOR = 2.0
"""Measured and predicted step times further apart than this factor are reported."""

_DIRECTION_LINKS = {  # store move direction -> links it uses
    "cpu->gpu": ("h2d",), "put->gpu": ("h2d",), "gpu->cpu": ("d2h",), "put->cpu": ("d2h",),
    "nvme->cpu": ("nvme_read",), "nvme->gpu": ("nvme_read", "h2d"),
    "cpu->nvme": ("nvme_write",), "put->nvme": ("nvme_write",),
}


def link_bytes(moved_bytes: Mapping[str, int]) -> dict[str, int]:
    """Return bytes per link from a store's ``moved_bytes`` (``{"cpu->gpu": n, ...}``).

    An nvme -> gpu move uses both the NVMe read and the H2D link. Unknown directions are
    ignored.
    """
    out = dict.fromkeys(LINKS, 0)
    for direction, n in moved_bytes.items():
        for link in _DIRECTION_LINKS.get(direction, ()):
            out[link] += n
    return out


@dataclass
class CostModel:
    """Predicts a step's time from bytes per link and CPU Adam work.

    Args:
        h2d_gbps: host -> device bandwidth, GB/s.
        d2h_gbps: device -> host bandwidth, GB/s.
        nvme_read_gbps: spill read bandwidth, GB/s.
        nvme_write_gbps: spill write bandwidth, GB/s.
        cpu_adam_gparams: CPU Adam rate, G parameters/s.
        ranges: per rate name (``"h2d_gbps"``, ...), the ``(slowest, fastest)`` of the probes
            that measured it, in the same unit (empty: no spread known).

    Raises:
        ValueError: a rate that is not a positive number, or a range that does not hold it.
    """

    h2d_gbps: float
    d2h_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    cpu_adam_gparams: float
    ranges: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in RATES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not value > 0 or math.isinf(value):
                raise ValueError(f"CostModel.{name}={value!r} must be a positive finite number")
        for name, (low, high) in self.ranges.items():
            if name not in RATES:
                raise ValueError(f"CostModel.ranges has unknown rate {name!r}; use {RATES}")
            if not 0 < low <= getattr(self, name) <= high:
                raise ValueError(f"CostModel.ranges[{name!r}]=({low!r}, {high!r}) must be "
                                 f"positive and hold {name}={getattr(self, name)!r}")

    def link_seconds(self, bytes_per_link: Mapping[str, int]) -> dict[str, float]:
        """Return seconds per link for ``{"h2d": bytes, "d2h": ..., "nvme_read": ...,
        "nvme_write": ...}`` (missing links: 0).

        Raises:
            ValueError: an unknown link name.
        """
        unknown = set(bytes_per_link) - set(LINKS)
        if unknown:
            raise ValueError(f"CostModel: unknown link(s) {sorted(unknown)}; use {LINKS} "
                             f"(tiermem.tune.link_bytes converts store directions)")
        rate = {"h2d": self.h2d_gbps, "d2h": self.d2h_gbps, "nvme_read": self.nvme_read_gbps,
                "nvme_write": self.nvme_write_gbps}
        return {link: bytes_per_link.get(link, 0) / (rate[link] * 1e9) for link in LINKS}

    def adam_seconds(self, adam_params: int) -> float:
        """Return the seconds the CPU Adam takes for ``adam_params`` parameters."""
        return adam_params / (self.cpu_adam_gparams * 1e9)

    def offload_seconds(self, bytes_per_link: Mapping[str, int], adam_params: int) -> float:
        """Return the serial time of all transfers and the CPU Adam (seconds)."""
        return sum(self.link_seconds(bytes_per_link).values()) + self.adam_seconds(adam_params)

    def predict_s(self, bytes_per_link: Mapping[str, int], adam_params: int = 0,
                  compute_s: float = 0.0, overlap: bool = False) -> float:
        """Predict a step's time in seconds.

        Args:
            bytes_per_link: bytes each link moves in one step (see :func:`link_bytes`).
            adam_params: parameters the CPU Adam steps in one step.
            compute_s: seconds of the step's own compute (forward, backward, GPU optimizer).
            overlap: everything overlaps perfectly (the largest term), else it adds up.

        Raises:
            ValueError: an unknown link name or a negative ``compute_s``.
        """
        if compute_s < 0:
            raise ValueError(f"CostModel.predict_s: compute_s={compute_s!r} must be >= 0 (seconds)")
        links = self.link_seconds(bytes_per_link)
        adam = self.adam_seconds(adam_params)
        if not overlap:
            return compute_s + sum(links.values()) + adam
        return max(compute_s, links["h2d"], links["d2h"], links["nvme_read"] + links["nvme_write"],
                   adam)

    def predict_range_s(self, bytes_per_link: Mapping[str, int], adam_params: int = 0,
                        compute_s: float = 0.0, overlap: bool = False) -> tuple[float, float]:
        """``(fastest, slowest)`` predicted seconds: :meth:`predict_s` with every rate at the
        fastest, then at the slowest of its probes (``ranges``; a rate without a range counts
        as exact). Same arguments and errors as :meth:`predict_s`."""
        fast = {n: self.ranges.get(n, (getattr(self, n),) * 2)[1] for n in RATES}
        slow = {n: self.ranges.get(n, (getattr(self, n),) * 2)[0] for n in RATES}
        return (CostModel(**fast).predict_s(bytes_per_link, adam_params, compute_s, overlap),
                CostModel(**slow).predict_s(bytes_per_link, adam_params, compute_s, overlap))

    def describe(self) -> str:
        """One line: every rate (the probes' median) with the probes' range."""
        def rate(name: str, label: str, unit: str, digits: int) -> str:
            value = f"{label} {getattr(self, name):.{digits}f} {unit}"
            if name in self.ranges:
                low, high = self.ranges[name]
                value += f" ({low:.{digits}f}-{high:.{digits}f})"
            return value
        return ", ".join((rate("h2d_gbps", "H2D", "GB/s", 1), rate("d2h_gbps", "D2H", "GB/s", 1),
                          rate("nvme_read_gbps", "NVMe read", "GB/s", 2),
                          rate("nvme_write_gbps", "write", "GB/s", 2),
                          rate("cpu_adam_gparams", "CPU Adam", "G params/s", 2)))

    @classmethod
    def measure(cls, device: str | torch.device = "auto", nbytes: int = 32 << 20,
                nvme_dir: str | None = None, adam_params: int = 1 << 20,
                probes: int = 3) -> "CostModel":
        """Measure the rates on this machine with small copies and CPU Adam calls.

        Args:
            device: the compute device (``"auto"``: CUDA if present). Without CUDA, H2D/D2H are
                host copies.
            nbytes: bytes per copy and per spill write/read.
            nvme_dir: directory for the spill timing (None: a temporary directory; it may be a
                RAM disk, so pass the real spill directory for real numbers).
            adam_params: parameters of the CPU Adam timing.
            probes: independent measurements of every rate; the median is the rate, the
                slowest and fastest go to ``ranges``.

        Raises:
            ValueError: ``probes`` < 1.
            OSError: ``nvme_dir`` is not writable.
        """
        from tiermem.optim.cpu_adam import adam_step_

        if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
            raise ValueError(f"CostModel.measure: probes={probes!r} must be an int >= 1")
        device = resolve_device(device, "CostModel.measure device")
        p, g, m, v = (torch.rand(adam_params) for _ in range(4))
        steps = itertools.count(1)
        seen: dict[str, list[float]] = {n: [] for n in RATES}
        for _ in range(probes):
            d2h_bps, h2d_bps = copy_bandwidths(device, nbytes)
            write_bps, read_bps = disk_bandwidths(nvme_dir, nbytes)
            adam = adam_params / best_time_s(lambda: adam_step_(
                p, g, m, v, step=next(steps), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0), repeat=3)
            for name, bps in zip(RATES, (h2d_bps, d2h_bps, read_bps, write_bps, adam)):
                seen[name].append(bps / 1e9)
        return cls(*(statistics.median(seen[n]) for n in RATES),
                   ranges={n: (min(seen[n]), max(seen[n])) for n in RATES} if probes > 1 else {})
