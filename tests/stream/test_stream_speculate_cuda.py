"""Note [streamed rollback] on a GPU: the CUDA twin of tests/stream/test_stream_speculate.py.
The streamed weights' gradients reach HybridAdam through the stream's D2H copies (Note [streamed
gradient hand-off]), a speculative step reads a single-piece chunk's host gradient in place, and
the clip of those host gradients (``speculate.clip_``) must come after ``step()`` has waited for
every admitted chunk's reads. With torch's default kernels (no SDPA backend pinned), a
speculating run and a waiting one (``rollback_bytes=0``) must agree at every step within the
waiting runs' own run-to-run difference (two waiting runs, per tensor and step: max |a - b|, x4;
0 where the kernels are deterministic, then bit for bit). The comparison going red on a stale
host copy is shown on the CPU (test_stream_speculate.py::
test_a_rollback_that_leaves_the_host_copy_stale_is_caught).
"""

from __future__ import annotations

import pytest
import torch

from optim.test_speculate import DECISIONS, _Probe
from test_stream_speculate import STEPS, _train, stores  # noqa: F401 (stores: a fixture)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"

CASES = [(c, r) for c in ("cpu-f1", "nvme-f05-acc2-nvmestate", "cpu-f05-acc2-major")
         for r in ("never", "always", "alternate", "nonfinite")]


@pytest.mark.parametrize("name,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_streamed_speculation_on_the_gpu_is_bit_identical(name, regime, stores, monkeypatch):
    active, rolled = DECISIONS[regime]
    probe = _Probe(monkeypatch)
    got, _ = _train(name, regime, stores, 1 << 30, probe, active, device=DEVICE)
    want, _ = _train(name, regime, stores, 0, device=DEVICE)
    again, _ = _train(name, regime, stores, 0, device=DEVICE)
    _within_noise(got, want, again, f"{name}-{regime}")
    results = probe.results[0][1]
    assert {s for s, r in enumerate(results) if r is not None} == active, results
    assert {s for s, r in enumerate(results) if r} == rolled, results


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _within_noise(got: list, want: list, again: list, what: str) -> None:
    """Every weight and state tensor of ``got`` within 4x the two waiting runs' difference of
    that tensor at that step (``want`` against ``again``): bit for bit where that is 0."""
    assert len(got) == len(want) == len(again) == STEPS
    for step, ((wg, sg), (ww, sw), (wa, sa)) in enumerate(zip(got, want, again)):
        for kind, g, w, a in (("weight", wg, ww, wa), ("state", sg, sw, sa)):
            assert g.keys() == w.keys() == a.keys()
            for k in w:
                noise = _diff(w[k], a[k])
                assert _diff(g[k], w[k]) <= 4 * noise, (
                    f"{what} step {step}: {kind} {k} differs by {_diff(g[k], w[k]):.3e}, "
                    f"the waiting runs' own difference {noise:.3e}")
