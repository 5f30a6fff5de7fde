"""HybridAdam on CUDA against an independent reference: fp32 masters + torch fused AdamW.

bf16 parameters on the GPU. The reference keeps its own fp32 masters (made once from the
initial weights, never copied from HybridAdam) and steps them with ``torch.optim.AdamW(
fused=True)`` on the GPU (fp32 moments), or, for ``moments_dtype=torch.bfloat16``, with the
same update in plain torch ops storing the moments rounded to bf16; params = masters cast.

Tolerance: HybridAdam's CPU kernel may round a master one ulp away from torch's CUDA kernel
(and a bf16 moment one bf16 ulp), and a master an ulp off can round to another bf16 param, so
the runs drift apart by chaos, not error. The bound is measured, not guessed: a second
reference run whose masters (and bf16 moments) are pushed one ulp in a random direction after
*every* step (the kernel's worst case on every element) gives the drift such differences can
cause; HybridAdam must stay within ``NOISE_MULTIPLE`` times it at every step's loss, the loss
of one more batch after the last step, and the final params (L2 over all of them). A parameter written back stale or never (one missed update is ~lr per element)
is orders of magnitude outside it.
"""

from __future__ import annotations

import pytest
import torch

from models import TinyGPT, make_batch
from tiermem import StoreConfig, TierStore
from tiermem.optim import HybridAdam

pytestmark = pytest.mark.cuda

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 10
NOISE_MULTIPLE = 4.0
SHAPE = dict(vocab=1024, d_model=512, n_heads=8, n_layers=4, seq_len=256)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(**SHAPE).cuda().to(torch.bfloat16)


def _batch(step: int):
    return make_batch(500 + step, batch=4, seq_len=256, vocab=1024, device="cuda")


class Reference:
    """fp32 masters + torch fused AdamW (or bf16-moment AdamW in torch ops), params = masters
    cast; ``jitter``: push masters (and bf16 moments) one ulp after every step."""

    def __init__(self, model: torch.nn.Module, bf16_moments: bool, jitter: bool,
                 max_grad_norm: float | None) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]
        self.bf16_moments, self.jitter, self.max_grad_norm = bf16_moments, jitter, max_grad_norm
        self.opt = torch.optim.AdamW(self.masters, **HP, fused=True)
        self.m = [torch.zeros_like(m, dtype=torch.bfloat16) for m in self.masters]
        self.v = [torch.zeros_like(m, dtype=torch.bfloat16) for m in self.masters]
        self.t = 0
        self.gen = torch.Generator(device="cuda").manual_seed(7)

    def _ulp(self, x: torch.Tensor) -> torch.Tensor:
        up = torch.rand(x.shape, generator=self.gen, device=x.device) < 0.5
        return torch.nextafter(x, torch.where(up, torch.inf, -torch.inf).to(x.dtype))

    @torch.no_grad()
    def step(self) -> None:
        if self.max_grad_norm is not None:  # what a user does with bf16 grads
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.t += 1
        if not self.bf16_moments:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
            self.opt.step()
        else:
            lr, (b1, b2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
            for i, (m, p) in enumerate(zip(self.masters, self.params)):
                g = p.grad.float()
                m1 = self.m[i].float().lerp_(g, 1 - b1)
                m2 = self.v[i].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                m.mul_(1 - lr * wd)
                denom = (m2.sqrt() / (1 - b2 ** self.t) ** 0.5).add_(eps)
                m.addcdiv_(m1, denom, value=-lr / (1 - b1 ** self.t))
                self.m[i], self.v[i] = m1.bfloat16(), m2.bfloat16()
        for i, (m, p) in enumerate(zip(self.masters, self.params)):
            if self.jitter:
                m.copy_(self._ulp(m))
                if self.bf16_moments:
                    self.m[i], self.v[i] = self._ulp(self.m[i]), self._ulp(self.v[i]).abs()
            p.copy_(m)
            p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _train(model: torch.nn.Module, opt) -> tuple[torch.Tensor, torch.Tensor]:
    losses = []
    for step in range(STEPS):
        _, loss = model(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    with torch.no_grad():  # the final params, seen through the loss of one more batch
        losses.append(model(*_batch(STEPS))[1])
    torch.cuda.synchronize()  # test only: read the results
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return torch.stack(losses).double().cpu(), params.cpu()


def _check(kw: dict, tmp_path, store: TierStore | None = None) -> None:
    bf16m = kw.get("moments_dtype") == torch.bfloat16
    clip = kw.get("max_grad_norm")
    ref_loss, ref_params = _train(model := _model(), Reference(model, bf16m, False, clip))
    jit_loss, jit_params = _train(model := _model(), Reference(model, bf16m, True, clip))
    model = _model()
    opt = HybridAdam(model.parameters(), **HP, nvme_dir=str(tmp_path), store=store, **kw)
    loss, params = _train(model, opt)
    opt.close()
    noise = torch.cummax((jit_loss - ref_loss).abs(), 0).values
    diff = (loss - ref_loss).abs()
    pnoise, pdiff = (jit_params - ref_params).norm().item(), (params - ref_params).norm().item()
    moved = (ref_params - torch.cat([p.detach().float().reshape(-1).cpu()
                                     for p in _model().parameters()])).norm().item()
    print(f"{kw}: loss diff {diff.max():.2e} (ulp-jitter noise {noise.max():.2e}); params "
          f"|diff| {pdiff:.3e} (noise {pnoise:.3e}, training moved them {moved:.3e})")
    assert moved > 20 * max(pnoise, 1e-12), "the reference must move far beyond the noise"
    assert (diff <= NOISE_MULTIPLE * noise + 1e-6 * ref_loss.abs()).all(), (
        f"loss {loss.tolist()} vs reference {ref_loss.tolist()} (noise {noise.tolist()})")
    assert pdiff <= NOISE_MULTIPLE * pnoise + 1e-12, (pdiff, pnoise)


@pytest.mark.parametrize("kw", [
    dict(offload_fraction=0.5),
    dict(offload_fraction=1.0),
    dict(offload_fraction=1.0, overlap=False),
    dict(offload_fraction=0.5, state_tier="nvme"),
    dict(offload_fraction=0.5, param_sync="forward"),
    dict(offload_fraction=0.5, max_grad_norm=0.5),
    dict(offload_fraction=1.0, gpu_step_fraction=0.5),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_fp32_masters_and_torch_fused_adamw(kw, tmp_path):
    _check(kw, tmp_path)


@pytest.mark.parametrize("kw", [
    dict(offload_fraction=1.0, moments_dtype=torch.bfloat16),
    dict(offload_fraction=1.0, moments_dtype=torch.bfloat16, gpu_step_fraction=1.0),
    dict(offload_fraction=1.0, moments_dtype=torch.bfloat16, gpu_step_fraction=1.0,
         max_grad_norm=0.5),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bf16_moments_match_a_bf16_moment_reference(kw, tmp_path):
    """The configuration behind the headline f=1 figures: bf16 moments through the GPU lane."""
    _check(kw, tmp_path)


def test_split_state_tier_matches(tmp_path):
    (tmp_path / "split").mkdir()
    store = TierStore(StoreConfig(device="cuda", gpu_bytes="1GiB", cpu_bytes="128MiB",
                                  nvme_bytes="1GiB", nvme_dir=str(tmp_path / "split"),
                                  pool_slab_bytes="8MiB", io_backend="posix"))
    try:
        _check(dict(offload_fraction=1.0, state_tier="split", chunk_numel=1 << 20), tmp_path,
               store)
    finally:
        store.close()


def test_a_stale_update_is_caught():
    """The check can fail: params one update behind (a missed write-back) are far outside."""
    ref_loss, ref_params = _train(model := _model(), Reference(model, False, False, None))
    jit_loss, jit_params = _train(model := _model(), Reference(model, False, True, None))
    model = _model()
    ref = Reference(model, False, False, None)
    losses = []
    for step in range(STEPS):
        _, loss = model(*_batch(step))
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        ref.step()
        if step == STEPS - 1:  # the last write-back lost
            with torch.no_grad():
                for p, b in zip(model.parameters(), before):
                    p.copy_(b)
        losses.append(loss.detach())
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).cpu()
    pdiff, pnoise = (params - ref_params).norm().item(), (jit_params - ref_params).norm().item()
    assert pdiff > NOISE_MULTIPLE * pnoise, (pdiff, pnoise)

