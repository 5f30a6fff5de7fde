"""The tuner's measured runs: :func:`tune` times a grid of settings under budgets and predicts each
from a :class:`~tiermem.apps.tune.cost.CostModel`.

``tune(factory, grid, steps=3, budgets=...)`` builds each setting's training step with
``factory(setting)``, runs a few steps, and measures step time, peak bytes per tier and stall
time in ``TierStore.get``; it marks the fastest setting that fits the budgets and prints a table
with the cost model's prediction beside each measurement (and bytes per link, peaks per tier and
the trial's own counters). With ``telemetry_dir`` it records each setting's last timed step and
writes a Chrome trace, a side-by-side memory timeline PNG and the results as JSON.

When ``compute_s`` is not given, :func:`tune` takes it from the setting the model says moves
least: its measured step time minus its predicted offload time (the compute is the same in every
setting). A setting whose measured time is more than twice the prediction, or less than half of
it, is reported (a WARNING on the ``tiermem`` logger and a line under the table): the model does
not describe it, so the measurement is what counts.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

import torch

from tiermem._log import logger, progress
from tiermem.config import TIERS, parse_bytes
from tiermem.apps.tune.cost import DISAGREE_FACTOR, CostModel, link_bytes
from tiermem.names import mib
from tiermem.apps.tune.report import format_table, write_telemetry
from tiermem.apps.tune.results import Result, Trial, expand_grid, setting_labels


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
                f"{result.stall_s * 1e3:.2f} ms, moved {mib(sum(result.moved_bytes.values()), 1)} "
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
