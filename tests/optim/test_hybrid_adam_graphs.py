"""CUDA graphs and HybridAdam (Note [cuda graphs] in tiermem/_graphs.py): a gradient hook,
the param_sync="forward" wait or step() inside a capture is refused with a clear error and the
optimizer stays usable; torch.cuda.make_graphed_callables trains as without graphs (CUDA)."""

from __future__ import annotations

import pytest
import torch

import tiermem._graphs as graphs
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(device="cpu", seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 64)).to(device)


def _batch(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 64, generator=g).to(device)


def _train(model, opt, steps, first=0, device="cpu", forward=None):
    forward = forward or model
    for step in range(first, first + steps):
        forward(_batch(step, device)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _params(model):
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("where", ["backward", "step", "forward"])
def test_capture_is_refused_and_the_optimizer_stays_usable(monkeypatch, where):
    model, ref = _mlp(), _mlp()
    kw = dict(lr=1e-2, offload_fraction=0.5, chunk_numel=1024,
              param_sync="forward" if where == "forward" else "step")
    opt, ref_opt = HybridAdam(model.parameters(), **kw), HybridAdam(ref.parameters(), **kw)
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    x = _batch(2)
    if where == "step":
        model(x).square().mean().backward()
    with monkeypatch.context() as m:
        m.setattr(graphs, "capturing", lambda t=None: True)
        with pytest.raises(RuntimeError, match=r"HybridAdam: .* ran inside a CUDA graph "
                                               r"capture .* make_graphed_callables"):
            if where == "step":
                opt.step()
            else:
                model(x).square().mean().backward()
    if where == "step":
        opt.step()  # the refused step, taken again outside the capture: step 2 done
    opt.zero_grad(set_to_none=True)
    _train(model, opt, *((3, 3) if where == "step" else (4, 2)))  # to step 5
    _train(ref, ref_opt, 4, first=2)  # as if the refused attempt had never been made
    opt.synchronize()  # param_sync="forward": the last update lands at the next forward
    ref_opt.synchronize()
    assert torch.equal(_params(model), _params(ref))
    opt.close()
    ref_opt.close()


def test_cpu_params_are_never_refused():
    model = _mlp()
    opt = HybridAdam(model.parameters(), lr=1e-2, offload_fraction=0.5, chunk_numel=1024)
    assert not graphs.capturing(next(model.parameters()))
    _train(model, opt, 1)
    opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_make_graphed_callables_trains_as_without_graphs(fraction):
    """The graphed module's gradients accumulate after each replay, so HybridAdam's hooks run
    eagerly: 8 steps, a new batch and new weights every step, against the same HybridAdam
    without graphs. The graph replays the kernels the eager run launches (no default-kernel
    noise in an MLP of matmuls and GELU), so the params must be equal. placement="given" in
    both: with "trace" the graphed backward's gradient order gives another GPU/CPU split, and
    the two Adam kernels round differently (Note [cuda graphs]; on the H200 f=0.5 then
    differed in the last bits while f=1.0, all on the CPU, was equal)."""
    kw = dict(lr=1e-3, offload_fraction=fraction, chunk_numel=4096, placement="given")
    eager = _mlp("cuda")
    eager_opt = HybridAdam(eager.parameters(), **kw)
    _train(eager, eager_opt, 8, device="cuda")
    graphed = _mlp("cuda")
    opt = HybridAdam(graphed.parameters(), **kw)
    sample = _batch(0, "cuda").requires_grad_(False)
    fn = torch.cuda.make_graphed_callables(graphed, (sample,))
    _train(graphed, opt, 8, device="cuda", forward=fn)
    eager_opt.synchronize()
    opt.synchronize()
    torch.cuda.synchronize()  # test only: read the results
    assert torch.equal(_params(graphed), _params(eager))
    assert not torch.equal(_params(graphed), _params(_mlp("cuda")))  # training moved them
    opt.close()
    eager_opt.close()


class _OneNode(torch.autograd.Function):
    """What make_graphed_callables' backward is to autograd: one node that returns the
    gradients of every param at once (here by recomputing the module's forward)."""

    @staticmethod
    def forward(ctx, module, x, *params):
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            params = list(ctx.module.parameters())
            grads = torch.autograd.grad(ctx.module(x.detach()), params, grad_out)
        return (None, None, *grads)


@pytest.mark.parametrize("placement", ["trace", "given"])
def test_one_node_backward_changes_only_the_traced_split(placement):
    """Note [cuda graphs]: gradients returned by one node arrive in another order than an
    eager backward's, so placement="trace" splits the state differently; "given" does not."""
    splits = []
    for one_node in (False, True):
        model = _mlp()
        opt = HybridAdam(model.parameters(), lr=1e-3, offload_fraction=0.5, chunk_numel=4096,
                         placement=placement)
        params = list(model.parameters())
        forward = (lambda x: _OneNode.apply(model, x, *params)) if one_node else model
        _train(model, opt, 1, forward=forward)
        splits.append([(pc.param, pc.start, pc.numel) for pc in opt._groups[0].plan.gpu_pieces])
        opt.close()
    assert (splits[0] != splits[1]) == (placement == "trace"), splits
