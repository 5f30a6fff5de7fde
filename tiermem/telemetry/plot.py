"""PNG of a :class:`~tiermem.telemetry.Recorder`'s memory timeline per tier, transfers marked.

One panel per tier with a budget (used bytes as a step line, the budget dashed, stalls in
``get`` shaded), and a bottom panel with one lane per stream (H2D, D2H, NVMe read/write) where
each move is a bar from its issue to its completion as observed by the store (host clock; the
copy itself may have been shorter, see :class:`~tiermem.telemetry.recorder.Transfer`). Step boundaries are vertical dotted lines.
:func:`plot_compare` draws several recordings side by side (one column each, same time and byte
scales), e.g. the same step under two eviction policies. Uses matplotlib's Agg canvas directly
(no GUI, no change to the global backend).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tiermem.config import TIERS

_COLORS = {"H2D": "tab:blue", "D2H": "tab:orange", "NVMe read": "tab:green",
           "NVMe write": "tab:red"}


def _figure(recorders: list, ncols: int) -> tuple[Any, Any, list[str], list[str]]:
    """Return ``(figure, axes[row, col], tiers, streams)`` for ``recorders`` in ``ncols``
    columns: one row per tier any of them uses, and the transfer lanes. A tier row's byte
    scale ends a little above the largest use or budget shown; a budget more than twice the
    largest use of its tier is left off the scale (named in the legend) so the use stays
    readable."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting a memory timeline needs matplotlib: "
                          "pip install 'tiermem[plot]'") from exc
    snaps = [r.snapshot() for r in recorders]
    tiers = [t for t in TIERS if any(r.budgets.get(t, 0) > 0 for r in recorders)
             or any(u.get(t, 0) for s in snaps for _, u in s[0])] or ["gpu"]
    streams = sorted({tr.stream for s in snaps for tr in s[1]}) or ["H2D"]
    fig = Figure(figsize=(11 if ncols == 1 else 2 + 6.5 * ncols, 2.2 * (len(tiers) + 1)),
                 dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(tiers) + 1, ncols, sharex=True, sharey="row", squeeze=False)
    for row, tier in zip(axes, tiers):
        used = max((u.get(tier, 0) for s in snaps for _, u in s[0]), default=0)
        shown = [b for r in recorders if 0 < (b := r.budgets.get(tier, 0)) <= 2 * used or not used]
        row[0].set_ylim(0, 1.08 * max([used, *shown, 1]) / 2**20)
    return fig, axes, tiers, streams


def _summary(transfers: list, stalls: list) -> str:
    moved = sum(tr.nbytes for tr in transfers if tr.ok)
    return (f"{len(transfers)} transfers, {moved / 2**20:.1f} MiB moved, "
            f"{sum(s.end_s - s.start_s for s in stalls):.3f} s stalled in get")


def _draw(axes: Any, recorder: Any, tiers: list[str], streams: list[str],
          label: str | None) -> None:
    """Draw ``recorder`` into one column of axes (a panel per tier, then the transfer lanes)."""
    samples, transfers, stalls, steps = recorder.snapshot()
    t0 = recorder.start_s
    end_s = max([t for t, _ in samples] + [tr.end_s for tr in transfers] + [t0]) - t0
    for ax, tier in zip(axes, tiers):
        xs = [t - t0 for t, _ in samples] + [end_s]
        ys = [u.get(tier, 0) / 2**20 for _, u in samples]
        ys = ys + ys[-1:] if ys else [0.0, 0.0]
        xs = xs if samples else [0.0, end_s]
        ax.step(xs, ys, where="post", color="black", linewidth=1.0, label="used")
        budget = recorder.budgets.get(tier, 0)
        if budget and budget / 2**20 <= ax.get_ylim()[1]:
            ax.axhline(budget / 2**20, color="gray", linestyle="--", linewidth=1.0, label="budget")
        elif budget:
            ax.plot([], [], color="gray", linestyle="--", label=f"budget {budget / 2**20:.0f} MiB "
                    f"(off scale)")
        for st in stalls:
            if st.tier == tier:
                ax.axvspan(st.start_s - t0, st.end_s - t0, color="tab:purple", alpha=0.15,
                           linewidth=0)
        ax.set_ylabel(f"{tier} [MiB]")
        ax.legend(loc="upper right", fontsize=7)
    lane = axes[-1]
    for i, stream in enumerate(streams):
        bars = [(tr.start_s - t0, max(tr.end_s - tr.start_s, end_s * 1e-4))
                for tr in transfers if tr.stream == stream]
        lane.broken_barh(bars, (i - 0.4, 0.8), color=_COLORS.get(stream, "tab:gray"))
    lane.set_yticks(range(len(streams)), streams)
    lane.set_ylim(-0.6, len(streams) - 0.4)
    lane.set_xlabel("time [s]; transfer bars: issue -> completion observed by the store (host "
                    "clock), not the copy's own duration")
    for ax in axes:
        for t in steps:
            ax.axvline(t - t0, color="tab:gray", linestyle=":", linewidth=0.8)
    if label is not None:
        axes[0].set_title(f"{label}\n{_summary(transfers, stalls)}", fontsize=9)


def plot_memory(recorder: Any, path: str | os.PathLike, *, title: str | None = None) -> None:
    """Write the memory timeline of ``recorder`` as a PNG to ``path``.

    Args:
        recorder: a :class:`~tiermem.telemetry.Recorder`.
        path: output file (``.png``).
        title: figure title (default: totals of the recording).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'tiermem[plot]'``).
        OSError: the file cannot be written.
    """
    fig, axes, tiers, streams = _figure([recorder], 1)
    _draw(axes[:, 0], recorder, tiers, streams, None)
    _, transfers, stalls, _ = recorder.snapshot()
    fig.suptitle(title or f"tiermem memory timeline: {_summary(transfers, stalls)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def plot_compare(recorders: Mapping[str, Any], path: str | os.PathLike, *,
                 title: str | None = None) -> None:
    """Write the memory timelines of several recordings side by side as a PNG to ``path``.

    One column per recording, in order, titled with its label and totals; every column has the
    same time axis (seconds from its recorder's start) and each tier row the same byte scale,
    so a longer or busier recording shows as such.

    Args:
        recorders: ``{label: Recorder}`` (at least one).
        path: output file (``.png``).
        title: figure title (default: none).

    Raises:
        ValueError: no recorders.
        ImportError: matplotlib is not installed (``pip install 'tiermem[plot]'``).
        OSError: the file cannot be written.
    """
    if not recorders:
        raise ValueError("plot_compare: give at least one recorder ({label: Recorder})")
    fig, axes, tiers, streams = _figure(list(recorders.values()), len(recorders))
    for col, (label, rec) in enumerate(recorders.items()):
        _draw(axes[:, col], rec, tiers, streams, label)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
