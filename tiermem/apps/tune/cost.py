"""The tuner's cost model: bytes per link and CPU Adam work -> predicted step time.

Each link moves its bytes at its bandwidth (H2D, D2H, NVMe read, NVMe write; the two NVMe
directions share the disk), the CPU Adam steps its parameters at its rate, and compute takes
``compute_s``. Serial prediction: the sum of all; overlapped (``overlap=True``): the largest of
compute, H2D, D2H, NVMe and CPU Adam (perfect overlap; a lower bound).

The rates are the planner's: a :class:`tiermem.rates.MachineRates` (one model of the machine for
``tiermem plan``, ``tiermem tune`` and ``examples/train_large.py``), of which the cost model
uses the fields in :data:`RATES`. How sure a prediction is: :meth:`CostModel.measure` probes
every rate ``probes`` times (3 by default, :meth:`tiermem.rates.MachineRates.measure`) and keeps
the median, with the slowest and fastest probe in ``CostModel.ranges``; each prediction then
has a range (:meth:`CostModel.predict_range_s`: every rate at its slowest probe, then at its
fastest).

Units: bandwidths in bytes/s, CPU Adam in parameters/s (:class:`~tiermem.rates.MachineRates`'
own), times in seconds, sizes in bytes; :meth:`CostModel.describe` prints GB/s and G params/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tiermem.rates import MEASURED, MachineRates

LINKS = ("h2d", "d2h", "nvme_read", "nvme_write")
"""Links of the cost model."""

LINK_RATES = {"h2d": "pcie_h2d_bytes_per_s", "d2h": "pcie_d2h_bytes_per_s",
              "nvme_read": "nvme_read_bytes_per_s", "nvme_write": "nvme_write_bytes_per_s"}
"""Each link's :class:`~tiermem.rates.MachineRates` field (bytes/s)."""

RATES = MEASURED
"""The :class:`~tiermem.rates.MachineRates` fields the cost model uses: the four links' (bytes/s)
and the CPU Adam's with fp32 moments (``cpu_adam_params_per_s``, params/s)."""

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
        rates: the machine's rates (:class:`tiermem.rates.MachineRates`, which checks them);
            the model uses the fields in :data:`RATES`. Default: the H200 machine's.
        ranges: per field of :data:`RATES` (``"pcie_h2d_bytes_per_s"``, ...), the
            ``(slowest, fastest)`` of the probes that measured it, in the field's unit
            (empty: no spread known).

    Raises:
        TypeError: ``rates`` is not a :class:`~tiermem.rates.MachineRates`.
        ValueError: a range of an unknown rate or one that does not hold the rate.
    """

    rates: MachineRates = field(default_factory=MachineRates)
    ranges: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rates, MachineRates):
            raise TypeError(f"CostModel.rates must be a tiermem.rates.MachineRates, got "
                            f"{type(self.rates).__name__}")
        for name, (low, high) in self.ranges.items():
            if name not in RATES:
                raise ValueError(f"CostModel.ranges has unknown rate {name!r}; use {RATES}")
            if not 0 < low <= getattr(self.rates, name) <= high:
                raise ValueError(f"CostModel.ranges[{name!r}]=({low!r}, {high!r}) must be "
                                 f"positive and hold {name}={getattr(self.rates, name)!r}")

    def link_seconds(self, bytes_per_link: Mapping[str, int]) -> dict[str, float]:
        """Return seconds per link for ``{"h2d": bytes, "d2h": ..., "nvme_read": ...,
        "nvme_write": ...}`` (missing links: 0).

        Raises:
            ValueError: an unknown link name.
        """
        unknown = set(bytes_per_link) - set(LINKS)
        if unknown:
            raise ValueError(f"CostModel: unknown link(s) {sorted(unknown)}; use {LINKS} "
                             f"(tiermem.apps.tune.link_bytes converts store directions)")
        return {link: bytes_per_link.get(link, 0) / getattr(self.rates, LINK_RATES[link])
                for link in LINKS}

    def adam_seconds(self, adam_params: int) -> float:
        """Return the seconds the CPU Adam takes for ``adam_params`` parameters."""
        return adam_params / self.rates.cpu_adam_params_per_s

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
        fast = dataclasses.replace(self.rates, **{n: hi for n, (_, hi) in self.ranges.items()})
        slow = dataclasses.replace(self.rates, **{n: lo for n, (lo, _) in self.ranges.items()})
        return (CostModel(fast).predict_s(bytes_per_link, adam_params, compute_s, overlap),
                CostModel(slow).predict_s(bytes_per_link, adam_params, compute_s, overlap))

    def describe(self) -> str:
        """One line: every rate (the probes' median) with the probes' range, in GB/s and
        G params/s."""
        def rate(name: str, label: str, unit: str, digits: int) -> str:
            value = f"{label} {getattr(self.rates, name) / 1e9:.{digits}f} {unit}"
            if name in self.ranges:
                low, high = self.ranges[name]
                value += f" ({low / 1e9:.{digits}f}-{high / 1e9:.{digits}f})"
            return value
        return ", ".join((rate("pcie_h2d_bytes_per_s", "H2D", "GB/s", 1),
                          rate("pcie_d2h_bytes_per_s", "D2H", "GB/s", 1),
                          rate("nvme_read_bytes_per_s", "NVMe read", "GB/s", 2),
                          rate("nvme_write_bytes_per_s", "write", "GB/s", 2),
                          rate("cpu_adam_params_per_s", "CPU Adam", "G params/s", 2)))

    @classmethod
    def measure(cls, device: str | torch.device = "auto", nbytes: int = 32 << 20,
                nvme_dir: str | None = None, adam_params: int = 1 << 20,
                probes: int = 3) -> "CostModel":
        """A cost model of this machine's rates: :meth:`tiermem.rates.MachineRates.measure`
        (small copies, spill-file writes and reads, CPU Adam calls; the rates the model does
        not use stay the H200 machine's).

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
        measured = MachineRates.measure(device, nbytes=nbytes, nvme_dir=nvme_dir,
                                        adam_params=adam_params, probes=probes,
                                        who="CostModel.measure")
        return cls(measured.rates, ranges=dict(measured.ranges))
