"""Usage: python scripts/bit_identity.py > docs/results/bit_identity_cpu.log

HybridAdam (f=1, CPU, fp32) vs torch.optim.AdamW(fused=True): max |param difference| over 50
steps on MLPs whose tensors do / do not all have a multiple of 16 elements (README.md, "bit-
identical"; tests/test_claims.py checks the same statement).
"""

import copy
import platform

import torch

from tiermem import _native
from tiermem.optim import HybridAdam


def mlp(dims, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])

def run(dims, seed, lr, steps=50):
    ref = mlp(dims, seed)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01, fused=True)
    opt = HybridAdam(model.parameters(), lr=lr, weight_decay=0.01, offload_fraction=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    worst = 0.0
    for _ in range(steps):
        x, y = torch.randn(32, dims[0], generator=gen), torch.randn(32, dims[-1], generator=gen)
        for m, o in ((ref, ref_opt), (model, opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad(set_to_none=True)
        worst = max(worst, max((a - b).abs().max().item()
                               for a, b in zip(ref.parameters(), model.parameters())))
    opt.close()
    return worst

print(f"# torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
      f"native Adam {_native.adam_isa()}, {torch.get_num_threads()} threads, {platform.machine()}")
print("# dims | numel % 16 per tensor | seed | lr | max |dparam| over 50 steps | / lr")
for dims in ([7, 13, 5, 3], [16, 32, 16]):
    numels = [p.numel() % 16 for p in mlp(dims, 0).parameters()]
    for seed in range(4):
        for lr in (1e-4, 1e-3, 1e-2, 1e-1):
            d = run(dims, seed, lr)
            print(f"{'->'.join(map(str, dims))} | {numels} | {seed} | {lr:g} | {d:.3g} | {d / lr:.3g}")
