"""What the tuner runs and what it measures: :class:`Trial` (one setting's training step, built by
the factory given to :func:`tiermem.apps.tune.tune`), :class:`Result` (its measurement), and the
grid
of settings (:func:`expand_grid`, :func:`setting_labels`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiermem.apps.tune.cost import link_bytes


@dataclass
class Trial:
    """One setting's training step, as built by the factory given to
    :func:`~tiermem.apps.tune.runner.tune`.

    Attributes:
        step: runs one training step.
        stores: the TierStores the step uses (their moved bytes, peaks and stalls are read).
        adam_params: parameters the CPU Adam steps per step (for the cost model).
        device_peak_bytes: returns the peak device bytes of the timed steps when they cannot be
            read from CUDA (e.g. an estimate on a CPU machine); None: the stores' gpu tiers.
        close: frees what the trial holds (called after its steps, also on error).
        telemetry_stores: the stores whose last timed step :func:`~tiermem.apps.tune.runner.tune`
            records with a
            :class:`~tiermem.telemetry.Recorder` when given a ``telemetry_dir`` (None: all of
            ``stores``).
        counters: returns cumulative counters of the trial (e.g. bytes evicted, steps the
            trace policy followed); :func:`~tiermem.apps.tune.runner.tune` reports their increase
            per timed step.
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
            step (empty unless :func:`~tiermem.apps.tune.runner.tune` got a ``telemetry_dir``).
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



def setting_labels(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """Return a short label per setting: ``name=value`` of the names whose values differ between
    the settings (``"policy=lru act_gpu_budget=1.5"``; names a setting lacks are left out);
    ``"setting N"`` when none differ."""
    names = list(dict.fromkeys(k for s in settings for k in s))
    varying = [n for n in names if len({repr(s.get(n)) for s in settings}) > 1]
    return [" ".join(f"{n}={s[n]}" for n in varying if n in s) or f"setting {i + 1}"
            for i, s in enumerate(settings)]
