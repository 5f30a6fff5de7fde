"""PNG of a :class:`~tiermem.telemetry.Recorder`'s memory timeline per tier, transfers marked.

One panel per tier with a budget (used bytes as a step line, the budget dashed, stalls in
``get`` shaded), and a bottom panel with one lane per stream (H2D, D2H, NVMe read/write) where
each move is a bar from its start to its end. Step boundaries are vertical dotted lines. Uses
matplotlib's Agg canvas directly (no GUI, no change to the global backend).
"""

from __future__ import annotations

import os
from typing import Any

from tiermem.config import TIERS

_COLORS = {"H2D": "tab:blue", "D2H": "tab:orange", "NVMe read": "tab:green",
           "NVMe write": "tab:red"}


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
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plot_memory needs matplotlib: pip install 'tiermem[plot]'") from exc
    samples, transfers, stalls, steps = recorder.snapshot()
    t0 = recorder.start_s
    tiers = [t for t in TIERS if recorder.budgets.get(t, 0) > 0
             or any(u.get(t, 0) for _, u in samples)] or ["gpu"]
    streams = sorted({tr.stream for tr in transfers}) or ["H2D"]
    fig = Figure(figsize=(11, 2.2 * (len(tiers) + 1)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(tiers) + 1, 1, sharex=True, squeeze=False)[:, 0]
    end_s = max([t for t, _ in samples] + [tr.end_s for tr in transfers] + [t0]) - t0
    for ax, tier in zip(axes, tiers):
        xs = [t - t0 for t, _ in samples] + [end_s]
        ys = [u.get(tier, 0) / 2**20 for _, u in samples]
        ys = ys + ys[-1:] if ys else [0.0, 0.0]
        xs = xs if samples else [0.0, end_s]
        ax.step(xs, ys, where="post", color="black", linewidth=1.0, label="used")
        budget = recorder.budgets.get(tier, 0)
        if budget:
            ax.axhline(budget / 2**20, color="gray", linestyle="--", linewidth=1.0, label="budget")
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
    lane.set_xlabel("time [s]")
    for ax in axes:
        for t in steps:
            ax.axvline(t - t0, color="tab:gray", linestyle=":", linewidth=0.8)
    moved = sum(tr.nbytes for tr in transfers if tr.ok)
    fig.suptitle(title or f"tiermem memory timeline: {len(transfers)} transfers, "
                 f"{moved / 2**20:.1f} MiB moved, {sum(s.end_s - s.start_s for s in stalls):.3f} s "
                 f"stalled in get", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
