"""The tuner's output: the results table (:func:`format_table`) and the telemetry files
(:func:`write_telemetry`: Chrome trace, memory timeline PNG, results as JSON)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence

from tiermem.config import TIERS
from tiermem.names import mib
from tiermem.apps.tune.cost import DISAGREE_FACTOR
from tiermem.apps.tune.results import Result, setting_labels


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
            cells += [mib(r.peak_bytes.get(t, 0), 1) for t in TIERS]
            cells += [mib(n, 1) for n in r.link_bytes().values()]
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
        lines.append("budgets: " + ", ".join(f"{t} {mib(b, 1)} MiB" for t, b in budgets.items())
                     + "; * = fastest setting that fits")
    for label, r in zip(setting_labels([r.setting for r in results]), results):
        if r.counters:  # per timed step; byte counts in MiB
            lines.append(f"{label}: " + ", ".join(
                f"{k.removesuffix('_bytes')} {mib(v, 1)} MiB" if k.endswith("_bytes")
                else f"{k} {v:g}" for k, v in r.counters.items()) + " per step")
    return "\n".join(lines)


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
