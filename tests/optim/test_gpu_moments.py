"""HybridAdam's GPU side with ``moments_dtype=torch.bfloat16`` (issue 19, lever (a)).

The GPU share (``1 - offload_fraction`` of each group, stepped by ``_step_gpu_side``) stores its
moments in bf16 and steps them as the GPU lane and the CPU kernel do: widened to fp32, torch's
fused Adam, rounded back to nearest even. On a CPU device the same code runs (the "GPU side" is
simply the share that is not offloaded), so these tests check it here; the CUDA variant runs the
same comparison on a GPU.

Why bit-for-bit holds on the CPU: torch's fused CPU kernel steps the last ``numel % 16``
elements of each tensor in a scalar loop that rounds differently from its vector body, while
tiermem's native kernel uses the vector body's formula for every element. TinyGPT's params, the
GPU/offloaded split and the chunks are all multiples of 16 elements (asserted below), so every
element goes through the vector formula wherever it is stepped: reference, GPU side, lane or
CPU kernel.
"""

from __future__ import annotations

import copy
import functools
import io
import math

import pytest
import torch

import tiermem.optim.step_tail as step_tail_mod
from models import TinyGPT, make_batch
from tiermem.optim import HybridAdam, layout

pytestmark = pytest.mark.usefixtures("one_thread")

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 10


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return TinyGPT().to(device=device, dtype=dtype)


def _groups(model):
    """Two groups with different hyper-parameters (decay and no decay)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]


def _group_hp(model):
    """(lr, weight_decay) per param of ``_groups(model)``, in ``model.parameters()`` order."""
    return [(1e-3, 0.0) if p.dim() < 2 else (HP["lr"], HP["weight_decay"])
            for p in model.parameters()]


class HandReference:
    """fp32 masters + AdamW done by hand in torch ops, the moments rounded to bf16 after every
    step (as tests/optim/test_hybrid_adam.py's and test_hybrid_adam_cuda.py's bf16-moment
    references), in the operation order of torch's fused kernel's vector body
    (native/adam.c's header): decoupled decay, lerp, ``v*b2 + (1-b2)*g*g``, ``sqrt(v) /
    sqrt(bc2) + eps``, ``p + (-lr/bc1 * m) / denom``. The square root is taken in float64
    and rounded: exactly the IEEE fp32 square root the kernels use (torch's CPU ``sqrt`` is
    not always correctly rounded). Params are the masters cast to the model dtype."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.hp = _group_hp(model)
        self.masters = [p.detach().float().clone() for p in self.params]
        self.m = [torch.zeros_like(m, dtype=torch.bfloat16) for m in self.masters]
        self.v = [torch.zeros_like(m, dtype=torch.bfloat16) for m in self.masters]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = HP["betas"]
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for i, (master, p) in enumerate(zip(self.masters, self.params)):
            lr, wd = self.hp[i]
            g = p.grad.float()
            m = self.m[i].float().lerp_(g, 1 - b1)
            v = self.v[i].float().mul_(b2).addcmul_(g, g, value=1 - b2)
            master.mul_(1 - lr * wd)
            denom = v.double().sqrt().float() / math.sqrt(bc2) + HP["eps"]
            master.add_((-lr / bc1) * m / denom)
            self.m[i], self.v[i] = m.bfloat16(), v.bfloat16()
            p.copy_(master)
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # step() dropped the gradients


class FusedReference:
    """fp32 masters + torch.optim.AdamW(fused=True), the moments rounded to bf16 after every
    step (``round_moments=False``: kept in fp32); params are the masters cast to the model
    dtype."""

    def __init__(self, model: torch.nn.Module, round_moments: bool = True) -> None:
        self.round_moments = round_moments
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        groups = _groups(model)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.opt = torch.optim.AdamW(
            [{**g, "params": [self.masters[index[id(p)]] for p in g["params"]]} for g in groups],
            **HP, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        for st in self.opt.state.values() if self.round_moments else ():
            for name in ("exp_avg", "exp_avg_sq"):
                st[name].copy_(st[name].bfloat16())  # stored in bf16, as HybridAdam stores them
        for m, p in zip(self.masters, self.params):
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _train(model, opt, steps=STEPS, device="cpu"):
    losses = []
    for step in range(steps):
        idx, tgt = make_batch(step)  # a different batch every step
        _, loss = model(idx.to(device), tgt.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _assert_aligned(opt):
    """The premise of bit-for-bit on the CPU (module docstring): every GPU piece and every
    offloaded chunk's piece is a multiple of 16 elements."""
    for g in opt._groups:
        pieces = list(g.plan.gpu_pieces) + [pc for c in g.plan.chunks for pc in c.pieces]
        assert all(pc.numel % 16 == 0 and pc.start % 16 == 0 for pc in pieces)


@functools.lru_cache(maxsize=None)
def _references(dtype: torch.dtype) -> dict:
    """Per reference (hand, fused, every element through the CPU kernel): the losses, the
    params, the masters and the moments (fp32, ``model.parameters()`` order) after ``STEPS``;
    computed once per model dtype."""
    out = {}
    hand_model, fused_model, cpu_model = _model(dtype), _model(dtype), _model(dtype)
    hand, fused = HandReference(hand_model), FusedReference(fused_model)
    cpu_opt = HybridAdam(_groups(cpu_model), **HP, chunk_numel=1024,
                         moments_dtype=torch.bfloat16, offload_fraction=1.0)
    out["hand"] = (_train(hand_model, hand), list(hand_model.parameters()), hand.masters,
                   [m.float() for m in hand.m], [v.float() for v in hand.v])
    out["fused"] = (_train(fused_model, fused), list(fused_model.parameters()), fused.masters,
                    [fused.opt.state[m]["exp_avg"] for m in fused.masters],
                    [fused.opt.state[m]["exp_avg_sq"] for m in fused.masters])
    out["cpu kernel"] = (_train(cpu_model, cpu_opt), list(cpu_model.parameters()),
                         *_state_by_param(cpu_model, cpu_opt))
    cpu_opt.close()
    return out


def _state_by_param(model, opt) -> tuple[list, list, list]:
    """HybridAdam's (masters, exp_avg, exp_avg_sq) in ``model.parameters()`` order (its
    state_dict numbers params in ``_groups`` order)."""
    state = opt.state_dict()["state"]
    order = [p for g in _groups(model) for p in g["params"]]
    by_id = {id(p): state[s] for s, p in enumerate(order)}
    sts = [by_id[id(p)] for p in model.parameters()]
    return ([st.get("master", p.detach()).view(p.shape) for st, p in zip(sts, model.parameters())],
            [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts])


@pytest.mark.parametrize("dtype, lane, batch_numel", [
    (torch.float32, 0.0, None),
    (torch.bfloat16, 0.0, None),
    (torch.float32, 0.0, 1024),
    (torch.bfloat16, 0.0, 1024),
    (torch.bfloat16, 0.5, 1024),
    (torch.float32, 0.5, None),
], ids=lambda v: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v, str(v)))
def test_bf16_gpu_moments_are_bit_identical_to_references(monkeypatch, dtype, lane, batch_numel):
    """bf16 moments on the device share: the moments are bf16 tensors, and 10 steps on
    different batches (two param groups) equal, bit for bit (losses, params, masters, moments),
    an AdamW done by hand with bf16 moments, torch's fused AdamW with its moments rounded to
    bf16, and the same model with every element stepped by the CPU kernel
    (offload_fraction=1.0); with and without the GPU lane stepping offloaded chunks.
    ``batch_numel=1024`` cuts the GPU side's widened batches at 1024 elements (pieces cut,
    small pieces sharing a batch): the same bits."""
    if batch_numel is not None:
        monkeypatch.setattr(step_tail_mod, "WIDE_BATCH_NUMEL", batch_numel)
    fraction = 0.25  # of the fractions in (0, 0.5), splits both groups at multiples of 16
    model = _model(dtype)
    opt = HybridAdam(_groups(model), **HP, chunk_numel=1024, moments_dtype=torch.bfloat16,
                     offload_fraction=fraction, gpu_step_fraction=lane)
    losses = _train(model, opt)
    _assert_aligned(opt)
    gpu_numel = opt.state_numel()["gpu"]
    assert 0 < gpu_numel < sum(p.numel() for p in model.parameters())
    if batch_numel is not None:
        assert max(pc.numel for g in opt._groups for pc in g.plan.gpu_pieces) > batch_numel
    for g in opt._groups:
        for t in g.gpu_exp_avg + g.gpu_exp_avg_sq:
            assert t.dtype == torch.bfloat16 and t.device == opt.device
        for m in g.gpu_masters:
            assert m.dtype == torch.float32
    if lane:
        assert opt.step_stats()["gpu_chunks"] > 0
    masters, exp_avg, exp_avg_sq = _state_by_param(model, opt)
    for name, (ref_losses, params, ref_masters, ref_m, ref_v) in _references(dtype).items():
        assert losses == ref_losses, name
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p, params[i]), (name, i)
            assert torch.equal(masters[i], ref_masters[i]), (name, i)
            assert exp_avg[i].dtype == torch.float32  # torch's format, as the chunks save
            assert torch.equal(exp_avg[i].view(-1), ref_m[i].view(-1)), (name, i)
            assert torch.equal(exp_avg_sq[i].view(-1), ref_v[i].view(-1)), (name, i)
    opt.close()


def test_fp32_moments_step_the_gpu_side_in_place_in_one_call(monkeypatch):
    """fp32 moments: the GPU side passes its own moment tensors to torch's fused Adam, once per
    group (no widened copies, no batches), and stays bit-identical to torch's fused AdamW."""
    calls = []
    real = step_tail_mod.fused_adam_

    def spy(params, grads, exp_avgs, exp_avg_sqs, steps, hp):
        calls.append((exp_avgs, exp_avg_sqs))
        real(params, grads, exp_avgs, exp_avg_sqs, steps, hp)

    monkeypatch.setattr(step_tail_mod, "fused_adam_", spy)
    monkeypatch.setattr(step_tail_mod, "fused_adam_moments_", None)  # never used with fp32
    model, ref = _model(), _model()
    opt = HybridAdam(_groups(model), **HP, offload_fraction=0.0, chunk_numel=1024)
    ref_opt = torch.optim.AdamW(_groups(ref), **HP, fused=True)
    assert _train(model, opt, 4) == _train(ref, ref_opt, 4)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert len(calls) == 4 * len(opt._groups)
    for g, (exp_avgs, exp_avg_sqs) in zip(opt._groups * 4, calls):
        assert all(a is b for a, b in zip(exp_avgs, g.gpu_exp_avg))
        assert all(a is b for a, b in zip(exp_avg_sqs, g.gpu_exp_avg_sq))
        assert all(t.dtype == torch.float32 for t in g.gpu_exp_avg + g.gpu_exp_avg_sq)
    opt.close()


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_fp32_moments_with_bf16_params_widen_gradients_in_bounded_batches(monkeypatch, fraction):
    """fp32 moments, bf16 params (issue 19): the GPU side widens its gradients to fp32
    ``WIDE_BATCH_NUMEL`` elements at a time (1024 here: pieces cut, small pieces sharing a
    batch), not its whole share at once. Every fused Adam call gets at most 1024 fp32
    gradient elements, and its moments are slices of the stored fp32 moments (stepped in
    place); each step makes the batches ``wide_batches`` gives, more than one per group. 10
    steps are bit-identical (losses, params, masters, moments) to the unbatched step (a batch
    bigger than the share: one call per group, what the step did before) and to torch's fused
    AdamW on fp32 masters."""
    calls = []
    real = step_tail_mod.fused_adam_moments_

    def spy(params, grads, exp_avgs, exp_avg_sqs, steps, hp):
        calls.append((grads, exp_avgs, exp_avg_sqs))
        real(params, grads, exp_avgs, exp_avg_sqs, steps, hp)

    monkeypatch.setattr(step_tail_mod, "fused_adam_moments_", spy)

    def run(batch_numel):
        monkeypatch.setattr(step_tail_mod, "WIDE_BATCH_NUMEL", batch_numel)
        calls.clear()
        model = _model(torch.bfloat16)
        opt = HybridAdam(_groups(model), **HP, chunk_numel=1024, offload_fraction=fraction)
        losses = _train(model, opt)
        _assert_aligned(opt)
        return model, opt, losses, list(calls)

    model, opt, losses, batched = run(1024)
    gpu_numels = [[pc.numel for pc in g.plan.gpu_pieces] for g in opt._groups]
    assert max(n for ns in gpu_numels for n in ns) > 1024  # some piece is cut
    per_step = sum(len(layout.wide_batches(ns, 1024)) for ns in gpu_numels)
    assert per_step > len(opt._groups) and len(batched) == STEPS * per_step
    stored = [t for g in opt._groups for t in g.gpu_exp_avg + g.gpu_exp_avg_sq]
    for grads, exp_avgs, exp_avg_sqs in batched:
        assert sum(gr.numel() for gr in grads) <= 1024
        assert all(gr.dtype == torch.float32 for gr in grads)
        for t in exp_avgs + exp_avg_sqs:  # a view into a stored fp32 moment: in place
            assert t.dtype == torch.float32
            assert any(t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                       for s in stored)
    masters, exp_avg, exp_avg_sq = _state_by_param(model, opt)

    whole_model, whole_opt, whole_losses, whole = run(1 << 30)
    assert len(whole) == STEPS * len(whole_opt._groups)  # one call per group and step
    ref_model = _model(torch.bfloat16)
    ref = FusedReference(ref_model, round_moments=False)
    ref_losses = _train(ref_model, ref)
    ref_state = ([m.view(p.shape) for m, p in zip(ref.masters, ref_model.parameters())],
                 [ref.opt.state[m]["exp_avg"] for m in ref.masters],
                 [ref.opt.state[m]["exp_avg_sq"] for m in ref.masters])
    for name, (other_losses, other_model, (o_masters, o_m, o_v)) in {
            "unbatched": (whole_losses, whole_model, _state_by_param(whole_model, whole_opt)),
            "torch fused": (ref_losses, ref_model, ref_state)}.items():
        assert losses == other_losses, name
        for i, (p, q) in enumerate(zip(model.parameters(), other_model.parameters())):
            assert torch.equal(p, q), (name, i)
            assert torch.equal(masters[i].view(-1), o_masters[i].view(-1)), (name, i)
            assert torch.equal(exp_avg[i].view(-1), o_m[i].view(-1)), (name, i)
            assert torch.equal(exp_avg_sq[i].view(-1), o_v[i].view(-1)), (name, i)
    opt.close()
    whole_opt.close()


def _run_steps(model, opt, start, steps):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(step)
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_moments_state_dict_round_trip_resumes_the_same_trajectory(dtype):
    """offload_fraction=0.5, bf16 moments: save after 3 steps, load into a fresh optimizer,
    3 more steps equal the uninterrupted run bit for bit; the saved moments are fp32 holding
    bf16 values, from the GPU side as from the chunks."""
    kw = dict(**HP, offload_fraction=0.5, chunk_numel=1024, moments_dtype=torch.bfloat16)
    model = _model(dtype)
    opt = HybridAdam(_groups(model), **kw)
    _run_steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    cont = _run_steps(model, opt, 3, 3)
    final = opt.state_dict()["state"]
    opt.close()

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    for st in saved["opt"]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            assert st[name].dtype == torch.float32
            assert torch.equal(st[name], st[name].bfloat16().float())
    torch.manual_seed(1)
    model2 = TinyGPT().to(dtype)
    model2.load_state_dict(saved["model"])
    opt2 = HybridAdam(_groups(model2), **kw)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state_numel()["gpu"] > 0 and opt2.state_numel()["offloaded"] > 0
    again = opt2.state_dict()["state"]  # loaded and gathered back: the same bits
    for i, st in saved["opt"]["state"].items():
        for name in st:
            assert torch.equal(again[i][name], st[name]), (i, name)
    assert _run_steps(model2, opt2, 3, 3) == cont
    for p, q in zip(model2.parameters(), model.parameters()):
        assert torch.equal(p, q)
    resumed = opt2.state_dict()["state"]
    for i in final:
        for name in final[i]:
            assert torch.equal(resumed[i][name], final[i][name]), (i, name)
    opt2.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_bf16_moments_shrink_the_gpu_state_by_4_bytes_per_device_param(dtype, fraction):
    """memory_bytes()["gpu"] (= layout.gpu_state_bytes() without a lane): moments 8 -> 4
    B/param on the device share; fp32 masters of bf16 params stay 4 B/param."""
    sizes = {}
    for moments in (torch.float32, torch.bfloat16):
        opt = HybridAdam(_model(dtype).parameters(), **HP, offload_fraction=fraction,
                         chunk_numel=1024, moments_dtype=moments)
        gpu_numel = opt.state_numel()["gpu"]
        sizes[moments] = opt.memory_bytes()["gpu"]
        assert sizes[moments] == opt._layout.gpu_state_bytes()
        per_param = (8 if moments == torch.float32 else 4) + (4 if dtype != torch.float32 else 0)
        assert sizes[moments] == per_param * gpu_numel
        opt.close()
    assert gpu_numel > 0
    assert sizes[torch.float32] - sizes[torch.bfloat16] == 4 * gpu_numel


@pytest.mark.cuda
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_cuda_bf16_gpu_moments_are_bit_identical_to_torch_cuda_fused(fraction):
    """On the GPU: bf16 params, bf16 moments, the device share stepped by ``_step_gpu_side`` and
    every offloaded chunk by the lane (the same torch CUDA kernel), against fp32 masters +
    torch.optim.AdamW(fused=True) on CUDA with its moments rounded to bf16 after every step:
    params, masters and moments bit-identical after 10 steps on different batches."""
    model = _model(torch.bfloat16, "cuda")
    ref_model = copy.deepcopy(model)
    ref = FusedReference(ref_model)
    opt = HybridAdam(_groups(model), **HP, offload_fraction=fraction, chunk_numel=4096,
                     moments_dtype=torch.bfloat16, gpu_step_fraction=1.0)
    losses = _train(model, opt, device="cuda")
    assert _train(ref_model, ref, device="cuda") == losses
    opt.synchronize()
    assert opt.step_stats()["gpu_chunks"] == opt.step_stats()["chunks"] > 0
    assert opt.state_numel()["gpu"] > 0
    for g in opt._groups:
        for t in g.gpu_exp_avg + g.gpu_exp_avg_sq:
            assert t.dtype == torch.bfloat16 and t.is_cuda
    state = opt.state_dict()["state"]  # numbered in _groups order
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    position = {id(p): i for i, p in enumerate(model.parameters())}
    for s, p in enumerate(q for g in _groups(model) for q in g["params"]):
        i = position[id(p)]
        assert torch.equal(state[s]["master"], ref.masters[i].cpu()), i
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[s][name], ref.opt.state[ref.masters[i]][name].cpu()), (i, name)
    opt.close()
