"""Note [lane unscale] with streamed weights: the GPU lane (on the CPU here) stepping chunks of
streamed weights' host copies under ``torch.amp.GradScaler`` speculates like HybridAdam's other
chunks (Note [streamed grad scaler]): each admitted lane chunk unscales its own gradient copy,
a skipped step restores it from its lane slot, a clipped one steps it again. The reference,
loop and configurations are tests/stream/test_stream_grad_scaler.py's (torch's AdamW(fused) +
GradScaler on the same GPT not streamed; infs on steps 3 and 6; the scale growing between):
losses, weights, moments and step counts bit for bit after every step, and every step's
speculated / rolled-back chunks the decisions' with the lane's chunks among them (before, lane
chunks waited for the verdict and were not counted).
"""

from __future__ import annotations

import pytest
import torch

from optim.test_grad_scaler_overlap import _decisions
from test_stream_grad_scaler import (BIG, CHUNK, CLIPS, CONFIGS, INF_STEPS, _differs, _reference,
                                     _train, stores)  # noqa: F401 (stores: the fixture)
from tiermem.optim import gpu_lane
from tiermem.optim.layout import chunk_state_bytes


def _run(name, stores, clip, lane, monkeypatch):
    """(first difference or None, counts per step, their decisions, unscale calls)."""
    lanes, calls = [], []
    init = gpu_lane.GpuLane.init

    def init_and_count(self):
        init(self)
        lanes.append((len(self.chunks), sum(len(g.plan.chunks) for g in self._layout.groups)))

    real = gpu_lane.unscale_lane_
    monkeypatch.setattr(gpu_lane.GpuLane, "init", init_and_count)
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda *a: calls.append(1) or real(*a))
    _, _, n_micro, major = CONFIGS[name]
    want = _reference(torch.float32, clip, INF_STEPS, n_micro, major)
    got, _ = _train(name, stores, BIG, clip, INF_STEPS, gpu_step_fraction=lane)
    skipped = [after < before for before, after in want[1]]
    n_lane, n_chunks = lanes[-1]  # every offloaded chunk, the lane's included
    decisions = _decisions(n_chunks, BIG // chunk_state_bytes(CHUNK, torch.float32), skipped,
                           want[2], CLIPS[clip][0])
    counts = [(s["speculated_chunks"], s["rolled_back_chunks"]) for s in got[3]]
    return _differs(got, want), counts, decisions, n_lane, len(calls)


@pytest.mark.parametrize("clip", [None, "alternate"], ids=["noclip", "alternate"])
@pytest.mark.parametrize("lane", [0.5, 1.0])
@pytest.mark.parametrize("name", ["cpu-f1", "nvme-f1", "cpu-f05-acc2"])
def test_streamed_lane_chunks_speculate_under_a_scaler(name, lane, clip, stores, monkeypatch,
                                                       one_thread):
    diff, counts, decisions, n_lane, calls = _run(name, stores, clip, lane, monkeypatch)
    assert diff is None, diff
    assert counts == decisions, (counts, decisions)
    assert n_lane > 0 and calls > 0  # lane chunks were speculated and unscaled their copies


def test_a_streamed_lane_that_steps_the_scaled_gradient_is_caught(stores, monkeypatch,
                                                                 one_thread):
    """Must-fail twin: the lane's unscale a no-op (it steps the scaled gradient copy)."""
    monkeypatch.setattr(gpu_lane, "unscale_lane_", lambda pieces, scale: None)
    _, _, n_micro, major = CONFIGS["cpu-f1"]
    want = _reference(torch.float32, None, INF_STEPS, n_micro, major)
    got, _ = _train("cpu-f1", stores, BIG, None, INF_STEPS, gpu_step_fraction=1.0)
    assert _differs(got, want) is not None
