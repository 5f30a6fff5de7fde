"""Note [streamed gradient norms] on a GPU: the CUDA twin of tests/stream/test_stream_clip_norm.py.
A streamed weight's gradient norm is taken on the device beside its D2H copy, so the global norm
``step()`` clips by must be, bit for bit, what the resident loop's ``get_total_norm`` computes
over the same gradients on the device (checked at every step against ``get_total_norm`` over
device copies of the gradients ``step()`` clips, in the same order), with every streamed norm
precomputed (``step_stats``). Against resident training (no stream) with torch's default
kernels, the per-step norms and the weights must agree within the resident runs' own
run-to-run difference (two resident runs, per step and tensor: max |a - b|, x4; 0 where the
kernels are deterministic, then bit for bit); ``offload_fraction=1.0`` only, since a streamed
weight's share of the GPU side steps on the host with the CPU kernel (Note [streamed
write-back]: other bits than the resident run's CUDA kernel). The comparisons going red are
shown on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from test_stream_clip_norm import CONFIGS, PRECOMPUTED, STEPS, _bits, _streamed_weights, \
    _train, stores  # noqa: F401 (stores: a fixture)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"

CASES = [(c, r) for c in ("one-pass", "one-pass-bf16", "acc2-major-nospec")  # offload 1.0
         for r in ("never", "always", "alternate")]


def _on_device(grads):
    """The resident loop's global norm of ``grads``: ``get_total_norm`` over device copies."""
    return torch.nn.utils.get_total_norm([g.to(DEVICE) for g in grads], 2.0).cpu()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("name,regime", CASES, ids=[f"{c}-{r}" for c, r in CASES])
def test_streamed_norms_on_the_gpu_are_the_resident_norms(name, regime, stores):
    assert name in CONFIGS and name in PRECOMPUTED
    got, totals, refs = _train(name, regime, stores, device=DEVICE, reference=_on_device)
    assert len(totals) == len(refs) == STEPS
    for step, (t, r) in enumerate(zip(totals, refs)):
        assert torch.equal(_bits(t), _bits(r)), f"step {step}: global norm {t} != {r}"
    n = _streamed_weights()
    assert [c for *_, c in got] == [(n, 0)] * STEPS
    want, want_totals, _ = _train(name, regime, stores, streamed=False, device=DEVICE)
    again, again_totals, _ = _train(name, regime, stores, streamed=False, device=DEVICE)
    for step in range(STEPS):
        noise = _diff(want_totals[step], again_totals[step])
        assert _diff(totals[step], want_totals[step]) <= 4 * noise, (
            f"step {step}: streamed norm {totals[step]} vs resident {want_totals[step]}, "
            f"the resident runs' own difference {noise:.3e}")
        for k in want[step][1]:
            noise = _diff(want[step][1][k], again[step][1][k])
            assert _diff(got[step][1][k], want[step][1][k]) <= 4 * noise, (
                f"step {step}: weight {k} differs by "
                f"{_diff(got[step][1][k], want[step][1][k]):.3e}, noise {noise:.3e}")
