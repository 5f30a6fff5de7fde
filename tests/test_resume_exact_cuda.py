"""Resume exactness on a GPU (Note [saved gradient order]): with the default
``placement="trace"`` the GPU side / offloaded split, and so the last bits (the GPU side steps
with torch's fused CUDA AdamW, the offloaded chunks with the CPU's), follow the first
backward's gradient order. A resumed HybridAdam took the given order instead. Now the state
dict carries the traced order: a run saved after 4 steps and resumed into a fresh model and
optimizer for 4 more matches the uninterrupted 8-step run at every step's loss and in the
final params within the reference's own run-to-run noise (two uninterrupted runs; 0 where the
kernels are deterministic). Twin: the order dropped from the saved state, the resumed
optimizer places its state elsewhere (must differ). CPU twins: tests/test_resume_exact.py.
"""

from __future__ import annotations

import pytest
import torch

from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
N, M = 4, 4


class _Reversed(torch.nn.Module):
    """Params registered in the reverse of their execution order: the traced and the given
    placements differ."""

    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(256, 256)
        self.mid = torch.nn.Linear(256, 256)
        self.inp = torch.nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _run(seed: int, start: int, steps: int, state=None, drop_order=False):
    """(losses, params, saved state, GPU-side param indices) after ``steps`` steps from
    ``start`` (loading ``state``, a ``(model, optimizer)`` state pair, first)."""
    torch.manual_seed(seed)
    model = _Reversed().cuda()
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=0.5, chunk_numel=4096)
    try:
        if state is not None:
            model.load_state_dict(state[0])
            saved = state[1]
            if drop_order:
                for group in saved["param_groups"]:
                    group.pop("tiermem_grad_order", None)
            opt.load_state_dict(saved)
        losses = []
        for s in range(start, start + steps):
            gen = torch.Generator().manual_seed(s)
            x = torch.randn(32, 64, generator=gen).cuda()
            loss = (model(x) - 0.5).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        opt.synchronize()
        gpu = sorted({pc.param for g in opt._groups for pc in g.plan.gpu_pieces})
        params = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        return losses, params, ({k: v.clone() for k, v in model.state_dict().items()},
                                opt.state_dict()), gpu
    finally:
        opt.close()


def _noise(a, b):
    return max(max(abs(x - y) for x, y in zip(a[0], b[0])), (a[1] - b[1]).abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_resumed_run_matches_the_uninterrupted_one_on_the_gpu():
    ref = _run(0, 0, N + M)
    noise = _noise(ref, _run(0, 0, N + M))
    first = _run(0, 0, N)
    resumed = _run(1, N, M, state=first[2])
    assert resumed[3] == ref[3], f"resumed GPU side {resumed[3]}, traced {ref[3]}"
    for i, (a, b) in enumerate(zip(first[0] + resumed[0], ref[0])):
        assert abs(a - b) <= noise, f"step {i}: loss {a!r} vs {b!r} (noise {noise})"
    diff = (resumed[1] - ref[1]).abs().max().item()
    assert diff <= noise, f"final params differ by {diff} (noise {noise})"
    # twin: without the saved order the resumed optimizer places its state as given
    twin = _run(1, N, M, state=_run(0, 0, N)[2], drop_order=True)
    assert twin[3] != ref[3], "the twin placed as traced: the test tests nothing"
