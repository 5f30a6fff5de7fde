"""Chrome trace JSON export of a :class:`~tiermem.telemetry.Recorder` (Perfetto, chrome://tracing).

Layout (JSON object format, ``{"traceEvents": [...], "displayTimeUnit": "ms"}``; times in
microseconds from the recorder's start):

* process 1 "tiermem transfers": one thread (track) per stream (H2D, D2H, NVMe read, NVMe
  write, ...) holding an ``"X"`` (complete) event per move, named ``src->dst``, with the key and
  bytes in ``args``. An event spans issue to *observed* completion on the host clock (see
  :class:`~tiermem.telemetry.recorder.Transfer`): the copy may have queued behind others and
  may have ended before the store noticed, so no rate is given (bytes over that span is not
  the link's bandwidth); ``otherData["transfer_spans"]`` says so in the file. A ``"stalls in
  get"`` track has an ``"X"`` event per blocked ``get``; step boundaries are global ``"i"``
  (instant) events.
* process 2 "tiermem memory": a ``"C"`` (counter) event per memory sample and tier, named
  ``"<tier> used bytes"``, plus the budgets in the metadata.

Moves that overlap on one stream (a store issues several copies at once) are legal in Perfetto
only if they nest; overlapping ones are moved to extra tracks ``"<stream> #2"``, ... so every
track holds a proper sequence.

:func:`merge_chrome_traces` puts several recordings in one file (e.g. the same step under two
eviction policies): recording ``i`` gets processes ``2i+1`` and ``2i+2``, named after its label,
each on its own time axis starting at 0, and its step boundaries are process-scoped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from tiermem.config import TIERS

TRANSFER_PID = 1
MEMORY_PID = 2
TRANSFER_SPANS = ("transfer events span issue to completion as observed by the store on the "
                  "host clock, not the copy itself; bytes / duration is not a link rate")
"""What a transfer event's duration is, written into every trace's ``otherData``."""


def _us(t_s: float, start_s: float) -> float:
    return round(max(0.0, t_s - start_s) * 1e6, 3)


def build_chrome_trace(recorder: Any, *, label: str | None = None, index: int = 0) -> dict:
    """Return the Chrome trace (a JSON-ready dict) of ``recorder``.

    Args:
        recorder: a :class:`~tiermem.telemetry.Recorder`.
        label: prefix of the process names (``"<label>: tiermem transfers"``); with it, step
            boundaries are scoped to the process instead of global.
        index: the recording's place in a merged file: its processes are ``2 * index + 1`` and
            ``2 * index + 2``.
    """
    samples, transfers, stalls, steps = recorder.snapshot()
    t0 = recorder.start_s
    transfer_pid, memory_pid = TRANSFER_PID + 2 * index, MEMORY_PID + 2 * index
    prefix = f"{label}: " if label is not None else ""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": transfer_pid, "tid": 0,
         "args": {"name": prefix + "tiermem transfers"}},
        {"ph": "M", "name": "process_name", "pid": memory_pid, "tid": 0,
         "args": {"name": prefix + "tiermem memory"}},
    ]
    tids: dict[str, int] = {}
    lane_ends: dict[str, list[float]] = {}  # per stream: end time (us) of each lane's last event

    def track(name: str) -> int:
        if name not in tids:
            tids[name] = len(tids) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": transfer_pid,
                           "tid": tids[name], "args": {"name": name}})
        return tids[name]

    for tr in sorted(transfers, key=lambda t: t.start_s):
        ts, end = _us(tr.start_s, t0), _us(max(tr.end_s, tr.start_s), t0)
        lanes = lane_ends.setdefault(tr.stream, [])
        for lane, lane_end in enumerate(lanes):
            if ts >= lane_end:
                break
        else:
            lane = len(lanes)
            lanes.append(0.0)
        lanes[lane] = end
        name = tr.stream if lane == 0 else f"{tr.stream} #{lane + 1}"
        dur = end - ts  # issue -> observed completion, not the copy's own duration
        events.append({"ph": "X", "name": tr.direction, "cat": "transfer", "pid": transfer_pid,
                       "tid": track(name), "ts": ts, "dur": dur,
                       "args": {"key": repr(tr.key), "bytes": tr.nbytes, "ok": tr.ok}})
    for st in stalls:
        ts = _us(st.start_s, t0)
        events.append({"ph": "X", "name": f"get from {st.tier}", "cat": "stall",
                       "pid": transfer_pid, "tid": track("stalls in get"), "ts": ts,
                       "dur": _us(max(st.end_s, st.start_s), t0) - ts,
                       "args": {"key": repr(st.key)}})
    for i, t in enumerate(steps):
        events.append({"ph": "i", "name": f"step {i + 1} end", "cat": "step",
                       "s": "g" if label is None else "p", "pid": transfer_pid, "tid": 0,
                       "ts": _us(t, t0)})
    for t, used in samples:
        ts = _us(t, t0)
        for tier in TIERS:
            events.append({"ph": "C", "name": f"{tier} used bytes", "cat": "memory",
                           "pid": memory_pid, "tid": 0, "ts": ts,
                           "args": {"bytes": int(used.get(tier, 0))}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"budget_bytes": dict(recorder.budgets),
                          "dropped": recorder.dropped,
                          "transfer_spans": TRANSFER_SPANS}}


def merge_chrome_traces(recorders: Mapping[str, Any]) -> dict:
    """Return one Chrome trace holding several recordings, ``{label: Recorder}`` in order (see
    the module docstring); ``otherData`` holds each one's budgets and drops by label."""
    events: list[dict] = []
    other = {}
    for i, (label, rec) in enumerate(recorders.items()):
        trace = build_chrome_trace(rec, label=label, index=i)
        events += trace["traceEvents"]
        other[label] = trace["otherData"]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def to_chrome_trace(recorder: Any, path: str | os.PathLike) -> dict:
    """Write ``recorder``'s Chrome trace JSON to ``path`` and return it; a mapping
    ``{label: Recorder}`` writes them all into one file (:func:`merge_chrome_traces`).

    Raises:
        OSError: the file cannot be written.
    """
    trace = merge_chrome_traces(recorder) if isinstance(recorder, Mapping) \
        else build_chrome_trace(recorder)
    with open(path, "w") as f:
        json.dump(trace, f)
    return trace
