"""Note [streamed rollback] on a GPU: the CUDA twin of tests/stream/test_stream_speculate.py.
The streamed weights' gradients reach HybridAdam through the stream's D2H copies (Note [streamed
gradient hand-off]), a speculative step reads a single-piece chunk's host gradient in place, and
the clip of those host gradients (``speculate.clip_``) must come after ``step()`` has waited for
every admitted chunk's reads. A speculating run and a waiting one (``rollback_bytes=0``) must be
bit-identical at every step: attention runs the math backend, whose kernels (like the rest of
this model's) are deterministic, so the two runs' backward passes agree bit for bit -- the
premise, asserted on two waiting runs.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from optim.test_speculate import DECISIONS, _Probe
from test_stream_speculate import _same, _train, stores  # noqa: F401 (stores: a fixture)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"

CASES = [(c, r) for c in ("cpu-f1", "nvme-f05-acc2-nvmestate", "cpu-f05-acc2-major")
         for r in ("never", "always", "alternate", "nonfinite")]


@pytest.mark.parametrize("name,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_streamed_speculation_on_the_gpu_is_bit_identical(name, regime, stores, monkeypatch):
    active, rolled = DECISIONS[regime]
    probe = _Probe(monkeypatch)
    with sdpa_kernel(SDPBackend.MATH):
        got, _ = _train(name, regime, stores, 1 << 30, probe, active, device=DEVICE)
        want, _ = _train(name, regime, stores, 0, device=DEVICE)
        again, _ = _train(name, regime, stores, 0, device=DEVICE)
    _same(again, want, f"the premise (two waiting runs) {name}-{regime}")
    _same(got, want, f"{name}-{regime}")
    results = probe.results[0][1]
    assert {s for s, r in enumerate(results) if r is not None} == active, results
    assert {s for s, r in enumerate(results) if r} == rolled, results
