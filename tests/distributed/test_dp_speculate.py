"""Note [speculative step] with ZeRO data parallel (gloo, 2 processes): the clip coefficient comes
from the all-reduced norm, the same on every rank, so every rank decides alike (speculations
stand or are rolled back everywhere); each rank rolls back only its own chunks. A speculating
job (``rollback_bytes`` holding every chunk) must leave parameters and the whole gathered state
bit-identical to the same job with ``rollback_bytes=0`` after 8 steps, in the four regimes of
tests/optim/test_speculate.py (never clipped, always, alternating, an inf and a nan norm), for
the cpu tier at ``offload_fraction=0.5`` and the nvme tier at 1 with accumulation.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_dp import ok, spawn_job  # noqa: E402

REGIMES = {"never": 1.0, "always": 1e-3, "alternate": 1.0, "nonfinite": 1.0}  # max_grad_norm
SETUPS = {"cpu-f05": dict(tier="cpu", fraction=0.5), "nvme-f1-acc2": dict(tier="nvme",
                                                                          fraction=1.0, accum=2)}
# regime -> steps whose rollbacks may be > 0 (state is planned at construction here, so step 0
# speculates; Note [speculation switch] for the rest)
ROLLED = {"never": set(), "always": {0, 1}, "alternate": {1, 3}, "nonfinite": {2, 7}}


def _configs() -> list[dict]:
    return [dict(name=f"{s}-{r}-{b}", kind="dp", clip=REGIMES[r], regime=r, steps=8,
                 rollback=b, **kw)
            for s, kw in SETUPS.items() for r in REGIMES for b in (1 << 30, 0)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_job(tmp_path_factory.mktemp("dist_spec"), _configs())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32) if t.dtype == torch.float32 else t.reshape(-1)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("regime", list(REGIMES))
def test_data_parallel_speculation_is_bit_identical(results, setup, regime):
    got, want = ok(results, f"{setup}-{regime}-{1 << 30}"), ok(results, f"{setup}-{regime}-0")
    for rank, (a, b) in enumerate(zip(got, want)):
        for name in b["params"]:
            assert torch.equal(_bits(a["params"][name]), _bits(b["params"][name])), (rank, name)
        assert a["state"].keys() == b["state"].keys()
        for key in b["state"]:
            assert torch.equal(_bits(a["state"][key]), _bits(b["state"][key])), (rank, key)
        assert all(s == (0, 0) for s in b["spec"]), b["spec"]  # the reference never speculates
        rolled = {s for s, (_, n) in enumerate(a["spec"]) if n}
        assert rolled <= ROLLED[regime], (rank, a["spec"])


def test_data_parallel_speculation_speculates_and_rolls_back(results):
    """Across the jobs, both ranks stepped chunks before the norm and rolled some back."""
    for rank in range(2):
        spec = [s for name in results if name.endswith(f"-{1 << 30}")
                for s in results[name][rank]["spec"]]
        assert sum(n for n, _ in spec) > 0 and sum(n for _, n in spec) > 0, (rank, spec)
