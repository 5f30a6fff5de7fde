"""HybridAdam's modes (tiermem/optim/modes.py): one process never enters the distributed code.

Issue 28: the local / data-parallel / FSDP2 differences are a strategy chosen once at
construction, so a single-process run neither imports ``tiermem.optim.distributed`` (nor
``tiermem.optim.dist_modes``) nor calls into it. Checked in a fresh interpreter, where nothing
else can have imported them: build HybridAdam with every one-process feature that used to pass
through the mode branches (trace placement, overlap on and off, clipping, param_sync="forward",
NVMe state, a state_dict round trip) and train 8 steps on changing batches.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tiermem.optim import HybridAdam
from tiermem.optim.modes import LocalMode

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    import torch
    from tiermem.optim import HybridAdam

    def run(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 8))
        opt = HybridAdam(model.parameters(), lr=1e-2, offload_fraction=0.5, chunk_numel=1024,
                         **kw)
        before = [p.detach().clone() for p in model.parameters()]
        for step in range(8):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        opt.load_state_dict(opt.state_dict())
        opt.close()

    run()
    run(overlap=False)
    run(max_grad_norm=0.5)
    run(param_sync="forward", placement="given")
    with tempfile.TemporaryDirectory() as d:
        run(state_tier="nvme", nvme_dir=d)
    entered = sorted(m for m in sys.modules
                     if m in ("tiermem.optim.distributed", "tiermem.optim.dist_modes"))
    print("ENTERED", entered)
""")


def test_a_single_process_run_never_imports_the_distributed_code():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ENTERED []" in out.stdout, out.stdout[-2000:]


def test_a_single_process_run_calls_no_distributed_mode(monkeypatch):
    """In this process too (where other tests may have imported the distributed modules):
    poisoned, they are never entered."""
    from tiermem.optim import dist_modes

    def refuse(*args, **kwargs):
        raise AssertionError("a single-process HybridAdam entered the distributed code")

    monkeypatch.setattr(dist_modes, "choose", refuse)
    for name in ("ZeroMode", "FsdpMode"):
        for attr in vars(getattr(dist_modes, name)):
            if callable(getattr(getattr(dist_modes, name), attr)) and not attr.startswith("__"):
                monkeypatch.setattr(getattr(dist_modes, name), attr, refuse)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = HybridAdam(model.parameters(), offload_fraction=0.5, chunk_numel=1024,
                     max_grad_norm=1.0)
    assert isinstance(opt._mode, LocalMode) and opt._mode.one_process
    for step in range(8):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    opt.close()


def test_data_parallel_without_torch_distributed_is_refused():
    """The one request that does enter the distributed modes in one process: a clear error."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="data_parallel=True needs torch.distributed"):
        HybridAdam(torch.nn.Linear(4, 4).parameters(), data_parallel=True)
