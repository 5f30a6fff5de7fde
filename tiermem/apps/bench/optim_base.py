"""What the optimizer benches share (``tiermem bench optim``, its ``--world N`` version and
``tiermem bench graphs``): the Adam hyper-parameters every setup trains with, and the GPU-only
baseline optimizer. A module of its own so that :mod:`tiermem.apps.bench.optim` (which starts the
``--world N`` run) and :mod:`tiermem.apps.bench.optim_dist` (which needs the hyper-parameters)
import it rather than each other (issue 28: no import circle)."""

from __future__ import annotations

import torch

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
"""AdamW's hyper-parameters in every optimizer bench setup (lr, betas, eps, weight decay)."""


class _GpuMasters:
    """fp32 masters + torch fused AdamW on the GPU, params = masters cast (the baseline)."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float() for p in self.params]
        # fused on CUDA (what GPU users run); torch's default elsewhere (fused on a 2-core CPU
        # measured 160x slower than foreach for small tensors)
        self.opt = torch.optim.AdamW(self.masters, **HP,
                                     fused=True if self.masters[0].is_cuda else None)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        for m, p in zip(self.masters, self.params):
            p.data.copy_(m)
            m.grad = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def close(self):
        pass
