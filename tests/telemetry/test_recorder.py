"""Recorder: memory timeline, transfers, stalls; Chrome trace JSON structure; PNG export."""

import json

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.telemetry import Recorder
from tiermem.telemetry.chrome import build_chrome_trace, to_chrome_trace
from tiermem.telemetry.plot import plot_compare

U = 4096


def make(tmp_path, recorder=None, **kw):
    return TierStore(StoreConfig(
        gpu_bytes=2 * U, cpu_bytes=3 * U, nvme_bytes=16 * U, nvme_dir=str(tmp_path),
        pool_slab_bytes=3 * U, io_backend="posix", io_threads=2, io_chunk_bytes=64 << 10,
        device="cpu", **kw), recorder=recorder)


def workload(store, steps=2):
    for k in range(6):
        store.put(k, torch.full((U // 4,), float(k)), tier="nvme")
    store.mark_step()
    for _ in range(steps):
        for k in range(6):
            assert store.get(k)[0].item() == k
        store.mark_step()
    store.delete(0)
    store.synchronize()


@pytest.fixture
def recorded(tmp_path):
    rec = Recorder()
    with make(tmp_path, rec, policy="trace", prefetch_lookahead=3) as store:
        workload(store)
        stats = store.stats()
    return rec, stats


def test_recorder_sees_every_move_memory_change_and_stall(recorded):
    rec, stats = recorded
    assert rec.budgets == {"gpu": 2 * U, "cpu": 3 * U, "nvme": 16 * U}
    moved = rec.bytes_by_direction()
    for direction, n in stats["moved_bytes"].items():
        assert moved.get(direction, 0) == n, direction  # every counted move was recorded
    for t in rec.transfers:
        assert t.end_s >= t.start_s and t.nbytes == U and t.ok
        assert t.stream in ("H2D", "D2H", "NVMe read", "NVMe write")
    times = [t for t, _ in rec.samples]
    assert times == sorted(times) and len(rec.samples) > 10
    for _, used in rec.samples:
        assert all(used[t] <= rec.budgets[t] for t in used)
    assert rec.peak_bytes()["gpu"] == 2 * U == stats["gpu"]["peak_bytes"]
    assert rec.samples[-1][1] == {t: stats[t]["used_bytes"] for t in ("gpu", "cpu", "nvme")}
    assert len(rec.steps) == 3 and rec.stalls and rec.stall_s() >= 0
    s = rec.summary()
    assert s["transfers"] == len(rec.transfers) and s["steps"] == 3


def test_no_recorder_costs_nothing_and_recorder_attaches_once(tmp_path):
    with make(tmp_path) as store:
        assert store.recorder is None
        workload(store, steps=1)
        rec = Recorder()
        store.recorder = rec  # attach later: starts with the current usage
        assert rec.samples and rec.samples[-1][1]["nvme"] == store.used_bytes("nvme")
        with make(tmp_path) as other:
            with pytest.raises(ValueError, match="another TierStore"):
                other.recorder = rec
    with pytest.raises(ValueError, match="max_events"):
        Recorder(max_events=0)


def test_recorder_keeps_at_most_max_events():
    rec = Recorder(max_events=50)
    for i in range(500):
        rec.transfer("cpu", "gpu", i, 1, 0.0, 1.0)
        rec.memory({"gpu": i, "cpu": 0, "nvme": 0})
    assert len(rec.transfers) <= 50 and len(rec.samples) <= 50 and rec.dropped > 0
    assert rec.transfers[-1].key == 499


def test_chrome_trace_is_valid_perfetto_json(recorded, tmp_path):
    rec, _ = recorded
    path = tmp_path / "trace.json"
    rec.to_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    assert doc == json.loads(json.dumps(build_chrome_trace(rec)))
    assert doc["displayTimeUnit"] in ("ms", "ns") and isinstance(doc["traceEvents"], list)
    names = {}  # (pid, tid) -> track name
    spans = {}
    counters = set()
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("M", "X", "C", "i"), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["name"], str)
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name") and "name" in ev["args"]
            if ev["name"] == "thread_name":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            continue
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            spans.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ev["ph"] == "C":
            assert set(ev["args"]) == {"bytes"} and isinstance(ev["args"]["bytes"], int)
            counters.add(ev["name"])
        else:
            assert ev["s"] in ("g", "p", "t")
    assert counters == {"gpu used bytes", "cpu used bytes", "nvme used bytes"}
    for track, items in spans.items():
        assert track in names  # every X event sits on a named track
        items.sort()
        for (a0, a1), (b0, b1) in zip(items, items[1:]):  # a track's events never overlap
            assert b0 >= a1 or b1 <= a1, (names[track], (a0, a1), (b0, b1))
    tracks = set(names.values())
    assert {"H2D", "NVMe read", "stalls in get"} <= tracks
    xs = [ev for ev in doc["traceEvents"] if ev["ph"] == "X" and ev["cat"] == "transfer"]
    assert len(xs) == len(rec.transfers)
    assert all({"key", "bytes"} <= set(ev["args"]) for ev in xs)


def test_plot_memory_writes_a_png(recorded, tmp_path):
    rec, _ = recorded
    path = tmp_path / "memory.png"
    rec.plot_memory(str(path))
    data = path.read_bytes()
    assert len(data) > 5000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.png"
    Recorder().plot_memory(str(empty))  # nothing recorded: still a (blank) figure
    assert empty.read_bytes()[:4] == b"\x89PNG"


def test_merged_chrome_trace_keeps_each_recording_in_its_own_processes(recorded, tmp_path):
    rec, _ = recorded
    single = build_chrome_trace(rec)["traceEvents"]
    doc = to_chrome_trace({"lru": rec, "trace": rec}, tmp_path / "both.json")
    assert json.loads((tmp_path / "both.json").read_text()) == json.loads(json.dumps(doc))
    events = doc["traceEvents"]
    assert len(events) == 2 * len(single) and set(doc["otherData"]) == {"lru", "trace"}
    assert {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"} == {
        (1, "lru: tiermem transfers"), (2, "lru: tiermem memory"),
        (3, "trace: tiermem transfers"), (4, "trace: tiermem memory")}
    for pid in (1, 3):  # the same transfers and steps under each label, steps per process
        assert sum(e["pid"] == pid and e["ph"] == "X" for e in events) == \
            sum(e["ph"] == "X" for e in single)
    assert {e["s"] for e in events if e["ph"] == "i"} == {"p"}


def test_plot_compare_writes_one_png_with_a_column_per_recording(recorded, tmp_path):
    rec, _ = recorded
    path = tmp_path / "both.png"
    plot_compare({"lru": rec, "empty": Recorder()}, path, title="two")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one"):
        plot_compare({}, tmp_path / "none.png")
