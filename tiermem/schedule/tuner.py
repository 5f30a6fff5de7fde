"""Policy tuner: time a grid of offload settings under budgets, predict each from a cost model.

``tune(factory, grid, steps=3, budgets=...)`` builds each setting's training step with
``factory(setting)``, runs a few steps, and measures step time, peak bytes per tier and stall
time in ``TierStore.get``; it marks the fastest setting that fits the budgets and prints a table
with the :class:`CostModel`'s prediction beside each measurement (and bytes per link, peaks per
tier and the trial's own counters). With ``telemetry_dir`` it records each setting's last timed
step and writes a Chrome trace, a side-by-side memory timeline PNG and the results as JSON.
``tiermem tune`` runs it on a GPT (:mod:`tiermem.models.gpt`; small by default, the reference
GPT with ``--layers 24 --d-model 2048 ...``) with activation offload and HybridAdam, over prefetch
depth, offloaded layers, optimizer offload fraction, state tier, store policy, the trace
policy's lookahead and the activation store's gpu budget (``--act-gpu-budget``: below
``prefetch depth + 1`` blocks' worth of activations, prefetches must evict, which is where the
``lru`` and ``trace`` policies differ).

Cost model: each link moves its bytes at its bandwidth (H2D, D2H, NVMe read, NVMe write; the two
NVMe directions share the disk), the CPU Adam steps its parameters at its rate, and compute takes
``compute_s``. Serial prediction: the sum of all; overlapped (``overlap=True``): the largest of
compute, H2D, D2H, NVMe and CPU Adam (perfect overlap; a lower bound). When ``compute_s`` is not
given, :func:`tune` takes it from the setting the model says moves least: its measured step time
minus its predicted offload time (the compute is the same in every setting).

How sure a prediction is: :meth:`CostModel.measure` probes every rate ``probes`` times (3 by
default) and keeps the median, with the slowest and fastest probe in ``CostModel.ranges``; each
prediction then has a range (:meth:`CostModel.predict_range_s`: every rate at its slowest probe,
then at its fastest), printed beside it. A setting whose measured time is more than twice the
prediction, or less than half of it, is reported (a WARNING on the ``tiermem`` logger and a line
under the table): the model does not describe it, so the measurement is what counts.

Units: bandwidths in GB/s (1e9 bytes/s), CPU Adam in G params/s (1e9 parameters/s), times in
seconds, sizes in bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from tiermem._log import logger, progress
from tiermem.config import TIERS, parse_bytes
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
                             f"(tiermem.schedule.tuner.link_bytes converts store directions)")
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
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu") \
            if str(device) == "auto" else torch.device(device)
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


@dataclass
class Trial:
    """One setting's training step, as built by the factory given to :func:`tune`.

    Attributes:
        step: runs one training step.
        stores: the TierStores the step uses (their moved bytes, peaks and stalls are read).
        adam_params: parameters the CPU Adam steps per step (for the cost model).
        device_peak_bytes: returns the peak device bytes of the timed steps when they cannot be
            read from CUDA (e.g. an estimate on a CPU machine); None: the stores' gpu tiers.
        close: frees what the trial holds (called after its steps, also on error).
        telemetry_stores: the stores whose last timed step :func:`tune` records with a
            :class:`~tiermem.telemetry.Recorder` when given a ``telemetry_dir`` (None: all of
            ``stores``).
        counters: returns cumulative counters of the trial (e.g. bytes evicted, steps the
            trace policy followed); :func:`tune` reports their increase per timed step.
    """

    step: Callable[[], Any]
    stores: Sequence[Any] = ()
    adam_params: int = 0
    device_peak_bytes: Callable[[], int] | None = None
    close: Callable[[], Any] | None = None
    telemetry_stores: Sequence[Any] | None = None
    counters: Callable[[], Mapping[str, float]] | None = None


@dataclass
class Result:
    """One setting's measurement.

    Attributes:
        setting: the grid point.
        step_s: median measured step time, seconds.
        peak_bytes: peak bytes per tier (``gpu``: ``torch.cuda.max_memory_allocated`` of the
            timed steps on CUDA, else the trial's estimate or its stores' gpu tiers; ``cpu`` /
            ``nvme``: the sum of the stores' peaks).
        stall_s: seconds per step callers blocked in ``TierStore.get``.
        moved_bytes: bytes per step per store direction (``"cpu->gpu"``, ...).
        adam_params: CPU Adam parameters per step.
        predicted_s: the cost model's step time (None without a model).
        predicted_range_s: ``(fastest, slowest)`` prediction from the model's probe ranges
            (None without a model).
        disagrees: measured and predicted step times differ by more than
            :data:`DISAGREE_FACTOR` (either way).
        fits: every tier's peak is within its budget (and the setting ran).
        best: the fastest setting that fits.
        error: why the setting failed (it then does not fit).
        telemetry: the :class:`~tiermem.telemetry.Recorder` of each telemetry store's last timed
            step (empty unless :func:`tune` got a ``telemetry_dir``).
        counters: the increase per timed step of each of the trial's ``counters``.
    """

    setting: dict
    step_s: float = math.nan
    peak_bytes: dict = field(default_factory=dict)
    stall_s: float = 0.0
    moved_bytes: dict = field(default_factory=dict)
    adam_params: int = 0
    predicted_s: float | None = None
    predicted_range_s: tuple[float, float] | None = None
    disagrees: bool = False
    fits: bool = False
    best: bool = False
    error: str | None = None
    telemetry: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)

    def link_bytes(self) -> dict[str, int]:
        """Bytes per link per step (``{"h2d": n, "d2h": n, "nvme_read": n, "nvme_write": n}``)."""
        return link_bytes(self.moved_bytes)


def expand_grid(grid: Mapping[str, Iterable] | Iterable[Mapping[str, Any]]) -> list[dict]:
    """Return the settings of a grid: a dict of value lists (their product) or a list of dicts.

    Raises:
        ValueError: an empty grid or an empty value list.
        TypeError: a grid of another shape.
    """
    if isinstance(grid, Mapping):
        names = list(grid)
        values = [list(grid[n]) for n in names]
        for n, v in zip(names, values):
            if not v:
                raise ValueError(f"tune: grid[{n!r}] is empty; give at least one value")
        settings = [dict(zip(names, combo)) for combo in itertools.product(*values)]
    else:
        settings = [dict(s) for s in grid]
        if not all(isinstance(s, dict) for s in settings):
            raise TypeError("tune: grid must be a dict of value lists or a list of dicts")
    if not settings:
        raise ValueError("tune: the grid is empty")
    return settings


def _store_totals(stores: Sequence[Any]) -> tuple[dict, float, dict]:
    moved: dict[str, int] = {}
    stall = 0.0
    peak = dict.fromkeys(TIERS, 0)
    for s in stores:
        st = s.stats()
        for d, n in st["moved_bytes"].items():
            moved[d] = moved.get(d, 0) + n
        stall += sum(st[t]["stall_s"] for t in TIERS)
        for t in TIERS:
            peak[t] += st[t]["peak_bytes"]
    return moved, stall, peak


def tune(step_fn_factory: Callable[[dict], Trial | Callable[[], Any]],
         grid: Mapping[str, Iterable] | Iterable[Mapping[str, Any]], steps: int = 3,
         budgets: Mapping[str, int | str] | None = None, *, warmup: int = 1,
         cost_model: CostModel | None = None, compute_s: float | None = None,
         overlap: bool = False, out: TextIO | None | str = "stdout",
         telemetry_dir: str | os.PathLike | None = None) -> list[Result]:
    """Run ``steps`` timed steps of every grid setting; return (and print) the results.

    Args:
        step_fn_factory: ``factory(setting)`` returns a :class:`Trial` (or just the step
            function) for one setting.
        grid: a dict of value lists (all combinations) or a list of setting dicts.
        steps: timed steps per setting (the median is reported), >= 1.
        budgets: byte budget per tier (``{"gpu": "40GiB"}``); a setting fits when its peaks are
            within them. None: everything that runs fits.
        warmup: untimed steps before timing (the trace policy records in them), >= 0.
        cost_model: predicts each setting (None: no prediction column).
        compute_s: compute seconds per step for the model (None: estimated, see module doc).
        overlap: predict with perfect overlap instead of serial sums.
        out: where the table goes: a text stream, ``"stdout"`` (``sys.stdout`` at call time),
            or None (not printed).
        telemetry_dir: record the last timed step of every setting (the trial's
            ``telemetry_stores``) and write there, via :func:`write_telemetry`: ``trace.json``
            (Chrome trace of every recorded step), ``timeline.png`` (every setting side by side;
            needs matplotlib, skipped with a note without it) and ``tune.json`` (the results),
            rewritten after every setting so that a run cut short keeps what it measured. The
            recording adds a few microseconds per store event to that step. None: no
            telemetry.

    Raises:
        ValueError: ``steps`` < 1, ``warmup`` < 0, an unknown budget tier, a bad grid.
        OSError: ``telemetry_dir`` cannot be written.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"tune: steps={steps!r} must be an int >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"tune: warmup={warmup!r} must be an int >= 0")
    budgets = {t: parse_bytes(b, f"budgets[{t!r}]") for t, b in (budgets or {}).items()}
    for t in budgets:
        if t not in TIERS:
            raise ValueError(f"tune: budgets has unknown tier {t!r}; use {TIERS}")
    if telemetry_dir is not None:
        os.makedirs(telemetry_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    stream = sys.stdout if out == "stdout" else out
    settings = expand_grid(grid)
    labels = setting_labels(settings)
    results = []
    bar = progress(total=len(settings) * (warmup + steps), desc="tune", unit="step")
    for setting, label in zip(settings, labels):
        bar.set_postfix_str(label, refresh=False)
        result = Result(setting)
        results.append(result)
        trial = None
        try:
            trial = step_fn_factory(dict(setting))
            if not isinstance(trial, Trial):
                trial = Trial(step=trial)
            for _ in range(warmup):
                trial.step()
                bar.update(1)
            moved0, stall0, _ = _store_totals(trial.stores)
            counters0 = dict(trial.counters()) if trial.counters is not None else {}
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(steps):
                if telemetry_dir is not None and i == steps - 1:
                    result.telemetry = _record(trial)
                t0 = time.perf_counter()
                try:
                    trial.step()
                    if cuda:
                        torch.cuda.synchronize()
                finally:
                    if result.telemetry:
                        _record(trial, stop=True)
                times.append(time.perf_counter() - t0)
                bar.update(1)
            moved1, stall1, peak = _store_totals(trial.stores)
            result.step_s = statistics.median(times)
            result.stall_s = (stall1 - stall0) / steps
            result.moved_bytes = {d: (n - moved0.get(d, 0)) // steps for d, n in moved1.items()
                                  if n - moved0.get(d, 0)}
            result.adam_params = trial.adam_params
            if trial.counters is not None:
                result.counters = {k: (v - counters0.get(k, 0)) / steps
                                   for k, v in trial.counters().items()}
            if cuda:
                peak["gpu"] = torch.cuda.max_memory_allocated()
            elif trial.device_peak_bytes is not None:
                peak["gpu"] = int(trial.device_peak_bytes())
            result.peak_bytes = peak
            result.fits = all(peak.get(t, 0) <= b for t, b in budgets.items())
        except Exception as exc:  # a setting that fails (no room, bad combination) is reported
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if trial is not None and trial.close is not None:
                trial.close()
        bar.n = len(results) * (warmup + steps)  # a failed setting skips its steps
        bar.refresh()
        if stream is not None:  # progress: what a run cut short still shows
            bar.clear()
            print(f"tune: {len(results)}/{len(settings)} {label}: " + (
                result.error or f"{result.step_s * 1e3:.1f} ms/step, stall "
                f"{result.stall_s * 1e3:.2f} ms, moved {_mib(sum(result.moved_bytes.values()))} "
                f"MiB"), file=stream, flush=True)
        if telemetry_dir is not None and result.telemetry:  # rewritten once all have run
            write_telemetry(results, telemetry_dir, budgets)
    bar.close()
    ran = [r for r in results if r.error is None]
    if cost_model is not None and ran:
        if compute_s is None:
            offload = {id(r): cost_model.offload_seconds(link_bytes(r.moved_bytes), r.adam_params)
                       for r in ran}
            least = min(ran, key=lambda r: offload[id(r)])
            compute_s = max(0.0, least.step_s - offload[id(least)])
        for r, label in zip(results, labels):
            if r.error is not None:
                continue
            r.predicted_s = cost_model.predict_s(link_bytes(r.moved_bytes), r.adam_params,
                                                 compute_s, overlap)
            r.predicted_range_s = cost_model.predict_range_s(link_bytes(r.moved_bytes),
                                                             r.adam_params, compute_s, overlap)
            ratio = r.step_s / r.predicted_s if r.predicted_s > 0 else math.inf
            r.disagrees = not 1 / DISAGREE_FACTOR <= ratio <= DISAGREE_FACTOR
            if r.disagrees:
                lo, hi = r.predicted_range_s
                logger.warning("tune: %s: measured %.1f ms/step, %.2gx the cost model's %.1f ms "
                               "(probe range %.1f-%.1f ms); the model does not describe this "
                               "setting: go by the measurement", label, r.step_s * 1e3, ratio,
                               r.predicted_s * 1e3, lo * 1e3, hi * 1e3)
    fitting = [r for r in ran if r.fits]
    if fitting:
        min(fitting, key=lambda r: r.step_s).best = True
    if stream is not None:
        print(format_table(results, budgets), file=stream, flush=True)
    if telemetry_dir is not None:
        for line in write_telemetry(results, telemetry_dir, budgets):
            if stream is not None:
                print(line, file=stream, flush=True)
    return results


def _record(trial: Trial, stop: bool = False) -> list:
    """Attach a fresh Recorder to each of ``trial``'s telemetry stores and return them; with
    ``stop``, detach them."""
    from tiermem.telemetry import Recorder

    stores = trial.stores if trial.telemetry_stores is None else trial.telemetry_stores
    recorders = []
    for store in stores:
        store.recorder = None if stop else Recorder()
        recorders.append(store.recorder)
    return recorders


def setting_labels(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """Return a short label per setting: ``name=value`` of the names whose values differ between
    the settings (``"policy=lru act_gpu_budget=1.5"``; names a setting lacks are left out);
    ``"setting N"`` when none differ."""
    names = list(dict.fromkeys(k for s in settings for k in s))
    varying = [n for n in names if len({repr(s.get(n)) for s in settings}) > 1]
    return [" ".join(f"{n}={s[n]}" for n in varying if n in s) or f"setting {i + 1}"
            for i, s in enumerate(settings)]


def write_telemetry(results: Sequence[Result], directory: str | os.PathLike,
                    budgets: Mapping[str, int] | None = None) -> list[str]:
    """Write the telemetry of :func:`tune`'s results into ``directory``; return one line per
    file written.

    Files (three, however many settings): ``trace.json``, one Chrome trace with every setting's
    recorded step (a pair of processes per setting and telemetry store, named by the setting's
    label, see :func:`setting_labels`); ``timeline.png``, the first telemetry store of every
    setting side by side (needs matplotlib: without it the line says it was skipped); and
    ``tune.json``: the budgets, the table and per setting its label, values and measurements
    (bytes per link, counters).

    Raises:
        OSError: a file cannot be written.
    """
    from tiermem.telemetry.chrome import to_chrome_trace

    directory = os.fspath(directory)
    labels = setting_labels([r.setting for r in results])
    traces, timelines, lines = {}, {}, []
    for r, label in zip(results, labels):
        for j, rec in enumerate(r.telemetry):
            traces[label + (f" store{j}" if len(r.telemetry) > 1 else "")] = rec
        if r.telemetry:
            timelines[label] = r.telemetry[0]
    if traces:
        to_chrome_trace(traces, os.path.join(directory, "trace.json"))
        lines.append(f"wrote {os.path.join(directory, 'trace.json')}: Chrome trace of "
                     f"{len(traces)} recorded steps (open in https://ui.perfetto.dev)")
    if timelines:
        try:
            from tiermem.telemetry.plot import plot_compare

            plot_compare(timelines, os.path.join(directory, "timeline.png"),
                         title="tiermem tune: bytes per tier and transfers in the last timed step")
            lines.append(f"wrote {os.path.join(directory, 'timeline.png')}")
        except ImportError as exc:
            lines.append(f"timeline.png skipped: {exc}")

    def num(x: float | None) -> float | None:
        return None if x is None or math.isnan(x) else x

    rows = [{"label": label, "setting": r.setting, "step_s": num(r.step_s),
             "stall_s": r.stall_s, "predicted_s": r.predicted_s, "link_bytes": r.link_bytes(),
             "moved_bytes": r.moved_bytes, "peak_bytes": r.peak_bytes,
             "adam_params": r.adam_params, "counters": r.counters, "fits": r.fits,
             "best": r.best, "error": r.error}
            for r, label in zip(results, labels)]
    with open(os.path.join(directory, "tune.json"), "w") as f:
        json.dump({"budgets": dict(budgets or {}), "table": format_table(results, budgets),
                   "results": rows}, f, indent=1, default=str)
    lines.append(f"wrote {os.path.join(directory, 'tune.json')}")
    return [f"telemetry: {line}" for line in lines]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def format_table(results: Sequence[Result], budgets: Mapping[str, int] | None = None) -> str:
    """Return the results as a text table (``*`` marks the fastest setting that fits)."""
    names = list(dict.fromkeys(k for r in results for k in r.setting))
    head = names + ["ms/step", "pred ms", "pred range", "stall ms", "gpu MiB", "cpu MiB",
                    "nvme MiB", "H2D MiB", "D2H MiB", "rd MiB", "wr MiB", "fits"]
    rows = []
    for r in results:
        cells = [str(r.setting.get(n, "")) for n in names]
        if r.error is not None:
            cells += ["-"] * (len(head) - len(names) - 1) + [f"no: {r.error[:60]}"]
        else:
            cells += [f"{r.step_s * 1e3:.1f}",
                      "-" if r.predicted_s is None else
                      f"{r.predicted_s * 1e3:.1f}" + (" !" if r.disagrees else ""),
                      "-" if r.predicted_range_s is None else
                      f"{r.predicted_range_s[0] * 1e3:.1f}-{r.predicted_range_s[1] * 1e3:.1f}",
                      f"{r.stall_s * 1e3:.2f}"]
            cells += [_mib(r.peak_bytes.get(t, 0)) for t in TIERS]
            cells += [_mib(n) for n in r.link_bytes().values()]
            cells.append(("yes *" if r.best else "yes") if r.fits else "no")
        rows.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in rows]
    lines.append("per step: stall = time blocked in TierStore.get; peak MiB per tier (gpu: the "
                 "device); MiB per link: H2D, D2H, NVMe read (rd) and write (wr)")
    if any(r.predicted_s is not None for r in results):
        lines.append("pred ms: the cost model (rates = median of its probes); pred range: every "
                     "rate at its slowest / fastest probe; ! = measured and predicted differ by "
                     f"more than {DISAGREE_FACTOR:g}x (the model does not describe that setting)")
    off = [(label, r) for label, r in zip(setting_labels([r.setting for r in results]), results)
           if r.disagrees]
    if off:
        lines.append(f"measured vs predicted off by more than {DISAGREE_FACTOR:g}x: " + "; ".join(
            f"{label} ({r.step_s * 1e3:.1f} vs {r.predicted_s * 1e3:.1f} ms)" for label, r in off))
    if budgets:
        lines.append("budgets: " + ", ".join(f"{t} {_mib(b)} MiB" for t, b in budgets.items())
                     + "; * = fastest setting that fits")
    for label, r in zip(setting_labels([r.setting for r in results]), results):
        if r.counters:  # per timed step; byte counts in MiB
            lines.append(f"{label}: " + ", ".join(
                f"{k.removesuffix('_bytes')} {_mib(v)} MiB" if k.endswith("_bytes")
                else f"{k} {v:g}" for k, v in r.counters.items()) + " per step")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- GPT demo


def _saved_bytes(model: torch.nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[int, int]:
    """Return the bytes autograd saves in one forward of ``model`` (each storage once,
    parameters not counted), and those first saved inside one of ``model.blocks``, per block
    (the mean; what offloading one block moves)."""
    seen: dict[int, int] = {}
    in_block: set[int] = set()
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen[s.data_ptr()] = s.nbytes()
            if inside[0]:
                in_block.add(s.data_ptr())
        return t

    hooks = [h for b in model.blocks for h in (
        b.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)),
        b.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)))]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, tgt)[1]
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    total = sum(n for ptr, n in seen.items() if ptr not in params)
    blocks = sum(seen[ptr] for ptr in in_block if ptr not in params)
    return total, blocks // max(1, len(model.blocks))


def act_gpu_bytes(value: float | str, block_bytes: int) -> int:
    """Return the activation store's gpu budget in bytes for an ``act_gpu_budget`` setting.

    Args:
        value: a number of blocks' worth of saved activations (``1.5``, ``"1.5"``: one and a
            half times what one block saves), or bytes with a unit (``"3GiB"``).
        block_bytes: bytes one block saves (see :func:`gpt_factory`).

    Raises:
        ValueError: not a positive number of blocks nor a byte size.
    """
    try:
        if isinstance(value, str) and value.strip()[-1:].isalpha():
            return parse_bytes(value, "act_gpu_budget")
        blocks = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"act_gpu_budget={value!r} is neither a number of blocks (1.5) nor a "
                         f"byte size with a unit ('3GiB')") from None
    if not blocks > 0 or math.isinf(blocks):
        raise ValueError(f"act_gpu_budget={value!r} must be a positive number of blocks")
    return max(1, int(blocks * block_bytes))


def gpt_factory(cfg: Any, batch: int, device: torch.device, nvme_dir: str,
                chunk_numel: int | None = None, cpu_threads: int | None = 1,
                dtype: torch.dtype = torch.float32) -> Callable[[dict], Trial]:
    """Return a factory of GPT training steps for :func:`tune`.

    Settings (all optional): ``num_layers`` (blocks whose activations are offloaded; 0: none;
    ``"auto"``: chosen by measurement, ``offload_activations(layers="auto")``),
    ``prefetch_depth``, ``offload_fraction`` and ``state_tier`` of HybridAdam, ``policy``
    (``"lru"`` / ``"trace"``), ``prefetch_lookahead`` and ``act_gpu_budget`` of the activation
    store. ``act_gpu_budget`` bounds the reloaded activations the store keeps on the device, in
    blocks' worth of saved activations (``1.5``) or bytes (``"3GiB"``, see
    :func:`act_gpu_bytes`); below ``prefetch_depth + 1`` blocks, prefetches must evict, which is
    where the policies differ. Default: twice all saved activations (never evicts). The
    activation store's cpu tier also holds twice the saved activations (pinned as needed, in
    256 MiB slabs). HybridAdam steps on ``cpu_threads`` threads (1 leaves the other cores to the
    model's compute; None: all), in chunks of ``chunk_numel`` parameters (None: nparams / 64
    within [2^14, 2^22]). Both stores call ``mark_step`` after every step; the activation store
    is the trial's telemetry store. The trial's counters: bytes offloaded (put into the store),
    evicted (gpu -> cpu moves other than puts) and refetched (reloads beyond one per offloaded
    byte), reloads copied past a full gpu tier (``direct_reloads``) and, with the trace policy,
    steps that followed its recording (1 per step when it always did). The model is built on
    ``device`` in ``dtype``. On a machine without CUDA the device peak is estimated as
    parameters + gradients + GPU-side optimizer state + the saved activations that stay on the
    device.

    The returned factory has ``saved_bytes`` (all saved activations of a step) and
    ``block_bytes`` (per block) attributes.
    """
    from tiermem.models.gpt import GPT
    from tiermem.config import StoreConfig
    from tiermem.offload import offload_activations
    from tiermem.optim import HybridAdam
    from tiermem.schedule.trace import TracePolicy
    from tiermem.store import TierStore
    from tiermem.store.policy import make_policy

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with device:  # initialised in place: a large model is slow to initialise on the host
            return GPT(cfg).to(dtype)

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
    probe = build()
    saved_bytes, block_bytes = _saved_bytes(probe, idx, tgt)
    del probe

    def factory(setting: dict) -> Trial:
        model = build()
        nparams = sum(p.numel() for p in model.parameters())
        fraction = float(setting.get("offload_fraction", 0.0))
        opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=fraction,
                         state_tier=setting.get("state_tier", "cpu"), nvme_dir=nvme_dir,
                         chunk_numel=chunk_numel or max(1 << 14, min(1 << 22, nparams // 64)),
                         cpu_threads=cpu_threads)
        act_bytes = max(1 << 20, 2 * saved_bytes)
        budget = setting.get("act_gpu_budget")
        policy = make_policy(setting.get("policy", "lru"))
        try:  # the pool pins 256 MiB slabs as they are needed, not its whole budget at once
            store = TierStore(StoreConfig(
                gpu_bytes=act_bytes if budget is None else act_gpu_bytes(budget, block_bytes),
                cpu_bytes=act_bytes, pool_slab_bytes=min(256 << 20, act_bytes),
                device=str(device), policy=policy,
                prefetch_lookahead=int(setting.get("prefetch_lookahead", 0))))
        except BaseException:
            opt.close()
            raise
        n = setting.get("num_layers", 0)
        layer_arg = {"layers": "auto"} if n == "auto" else {"num_layers": int(n)}
        off = offload_activations(model.blocks, store=store, **layer_arg,
                                  prefetch_depth=int(setting.get("prefetch_depth", 1))) \
            if n == "auto" or int(n) > 0 else None
        put_per_step = [0]

        def step() -> None:
            before = off.counters["put_bytes"] if off is not None else 0
            with off if off is not None else contextlib.nullcontext():
                loss = model(idx, tgt)[1]
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            store.mark_step()
            opt._store.mark_step()
            put_per_step[0] = (off.counters["put_bytes"] if off is not None else 0) - before

        def device_peak() -> int:
            static = sum(p.numel() * p.element_size() * 2 for p in model.parameters())
            return static + opt.memory_bytes()["gpu"] + max(0, saved_bytes - put_per_step[0]) \
                + store.stats()["gpu"]["peak_bytes"]

        def counters() -> dict[str, float]:
            moved = store.stats()["moved_bytes"]
            put = off.counters["put_bytes"] if off is not None else 0
            out = {"offloaded_bytes": put,  # D2H counts the puts only from a device
                   "evicted_bytes": moved.get("gpu->cpu", 0) - (put if device.type != "cpu" else 0),
                   "refetched_bytes": moved.get("cpu->gpu", 0) - put}
            if off is not None:
                out["direct_reloads"] = off.counters["gpu_full"]
            if isinstance(policy, TracePolicy):
                out["followed_steps"] = policy.counts["followed_steps"]
            return out

        def close() -> None:
            opt.close()
            store.close()

        return Trial(step=step, stores=[store, opt._store],
                     adam_params=int(round(fraction * nparams)),
                     device_peak_bytes=None if device.type == "cuda" else device_peak,
                     close=close, telemetry_stores=[store], counters=counters)

    factory.saved_bytes = saved_bytes  # type: ignore[attr-defined]
    factory.block_bytes = block_bytes  # type: ignore[attr-defined]
    return factory


def _layer_count(text: str) -> int | str:
    """``"auto"`` or an int (``--num-layers`` values)."""
    return "auto" if text.strip() == "auto" else int(text)


def _csv(kind: Callable[[str], Any], name: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}: {text!r} is not a comma-separated list") \
                from None
    return parse


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tiermem tune", description="Time a grid of offload settings on a small GPT "
        "(activation offload + HybridAdam), predict each from a cost model, and mark the "
        "fastest setting that fits the budgets.")
    g = p.add_argument_group("model (defaults: a tiny GPT that runs on a CPU in seconds)")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    g.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--seq", type=int, default=64, help="sequence length in tokens (default 64)")
    g.add_argument("--batch", type=int, default=4, help="micro-batch in sequences (default 4)")
    g.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    g = p.add_argument_group("grid (comma-separated values)")
    g.add_argument("--prefetch-depth", type=_csv(int, "prefetch-depth"), default=[1, 2],
                   help="activation layers reloaded ahead (default 1,2)")
    g.add_argument("--num-layers", type=_csv(_layer_count, "num-layers"), default=None,
                   help="blocks whose activations are offloaded, or auto (chosen by measured "
                   "compute vs transfer; default 0,L-1)")
    g.add_argument("--offload-fraction", type=_csv(float, "offload-fraction"),
                   default=[0.0, 0.5, 1.0], help="HybridAdam offload_fraction (default 0,0.5,1)")
    g.add_argument("--state-tier", type=_csv(str, "state-tier"), default=["cpu", "nvme"],
                   help="HybridAdam state tier: cpu,nvme (default both)")
    g.add_argument("--policy", type=_csv(str, "policy"), default=["lru"],
                   help="activation store policy: lru,trace (default lru)")
    g.add_argument("--prefetch-lookahead", type=_csv(int, "prefetch-lookahead"), default=[16],
                   help="accesses the trace policy prefetches ahead along its recording "
                   "(trace settings only; default 16)")
    g.add_argument("--act-gpu-budget", type=_csv(str, "act-gpu-budget"), default=None,
                   help="activation store gpu budget: blocks' worth of saved activations (1.5) "
                   "or bytes (3GiB); below prefetch depth + 1 blocks prefetches evict, which is "
                   "where lru and trace differ (default: room for everything, no eviction)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per setting; the trace policy records in them (default 2)")
    p.add_argument("--gpu-budget", default=None,
                   help="device byte budget, e.g. 40GiB (default: 3/4 of the no-offload need)")
    p.add_argument("--cpu-budget", default=None, help="host byte budget (default: none)")
    p.add_argument("--nvme-dir", default=None, help="spill directory (default: a temporary one)")
    p.add_argument("--overlap", action="store_true",
                   help="predict with perfect overlap instead of serial sums")
    p.add_argument("--no-model", action="store_true", help="skip the cost-model measurement")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="HybridAdam CPU threads (default: all on CUDA, 1 on CPU)")
    p.add_argument("--telemetry-dir", default=None,
                   help="record each setting's last timed step (activation store) and write "
                   "there trace.json (Chrome trace, all settings), timeline.png (memory per tier "
                   "and transfers, settings side by side) and tune.json (the results)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads={args.cpu_threads} must be >= 1")
    for value in args.act_gpu_budget or ():
        act_gpu_bytes(value, 1)  # raises for a value that is neither blocks nor bytes
    for la in args.prefetch_lookahead:
        if la < 0:
            raise ValueError(f"--prefetch-lookahead={la} must be >= 0")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    for t in args.state_tier:
        if t not in ("cpu", "nvme"):
            raise ValueError(f"--state-tier: {t!r} is not cpu or nvme")
    for pol in args.policy:
        if pol not in ("lru", "trace"):
            raise ValueError(f"--policy: {pol!r} is not lru or trace")
    return args


def demo_grid(args: argparse.Namespace) -> list[dict]:
    """Return the demo's settings without redundant points (state tier of an empty offload,
    prefetch depth without offloaded layers)."""
    layers = args.num_layers if args.num_layers is not None else sorted({0, args.layers - 1})
    budgets = getattr(args, "act_gpu_budget", None) or [None]
    lookaheads = getattr(args, "prefetch_lookahead", None) or [16]
    out, seen = [], set()
    for pol, n, d, f, t, b, la in itertools.product(
            args.policy, layers, args.prefetch_depth, args.offload_fraction, args.state_tier,
            budgets, lookaheads):
        s = dict(policy=pol, num_layers=n, prefetch_depth=d if n else args.prefetch_depth[0],
                 offload_fraction=f, state_tier=t if f > 0 else args.state_tier[0])
        if b is not None:
            s["act_gpu_budget"] = b if n else budgets[0]
        if pol == "trace":
            s["prefetch_lookahead"] = la
        key = tuple(sorted(s.items()))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``tiermem tune``: run the GPT demo grid; return 0, or 1 when no setting fits.

    Raises:
        ValueError: bad arguments (the CLI prints them as one line, exit code 2).
    """
    from tiermem.models.gpt import GPTConfig

    args = _parse_args(sys.argv[1:] if argv is None else list(argv))
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or
                                                            ("bf16" if cuda else "fp32")]
    with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="tiermem-tune-") as nvme_dir:
        factory = gpt_factory(cfg, args.batch, device, nvme_dir, dtype=dtype,
                              cpu_threads=args.cpu_threads if args.cpu_threads or cuda else 1)
        budgets: dict[str, int | str] = {}
        if args.gpu_budget is not None:
            budgets["gpu"] = args.gpu_budget
        else:  # params, grads, fp32 Adam state and all activations on the device, times 3/4
            need = 0
            if not cuda:  # on CUDA the trial reads no estimate: skip building one
                probe = factory(dict(num_layers=0))
                try:
                    need = probe.device_peak_bytes()
                finally:
                    probe.close()
            budgets["gpu"] = int(0.75 * max(need, 16 * cfg.num_params()))
        if args.cpu_budget is not None:
            budgets["cpu"] = args.cpu_budget
        model = None if args.no_model else CostModel.measure(device, nbytes=8 << 20,
                                                             nvme_dir=nvme_dir,
                                                             adam_params=1 << 18)
        settings = demo_grid(args)
        print(f"tiermem tune: GPT {cfg.n_layers}x{cfg.d_model}, {cfg.num_params() / 1e6:.2f}M "
              f"params ({str(dtype).removeprefix('torch.')}), batch {args.batch}x{cfg.seq_len} on "
              f"{device}; {len(settings)} settings x {args.steps} steps; saved activations "
              f"{_mib(factory.saved_bytes)} MiB per step, {_mib(factory.block_bytes)} MiB per "
              f"block", flush=True)
        if model is not None:
            print(f"cost model: {model.describe()} (median of 3 probes, their range in "
                  f"brackets)", flush=True)
        results = tune(factory, settings, steps=args.steps, budgets=budgets, warmup=args.warmup,
                       cost_model=model, overlap=args.overlap, telemetry_dir=args.telemetry_dir)
    return 0 if any(r.best for r in results) else 1
