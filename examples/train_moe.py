"""Train the mixture-of-experts transformer (tiermem.models.MoE) with HybridAdam + activation offload.

    python examples/train_moe.py                       # CPU, fp32
    python examples/train_moe.py --steps 50 --experts 16 --top-k 2 --offload-fraction 0.5

Top-``k`` of ``--experts`` experts per block on a generated Markov-chain token stream
(:class:`tiermem.apps.demo.MarkovText`, nothing downloaded). It trains twice from the same init on
the same batches: with tiermem (HybridAdam keeps ``--offload-fraction`` of the optimizer state in
the store's cpu tier and steps it on the CPU during backward; the saved activations of all
blocks but the last go to the cpu tier and come back in backward) and without (torch AdamW, no
offload). Experts that get no token in a step get no gradient and are skipped by both
optimizers. Prints, as each step finishes, its loss (the offloaded run's beside the first run's)
and the experts left without tokens, then whether the two runs agree. Exit code: 0 they agree
within ``--tolerance``, 1 they differ.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch

from tiermem import StoreConfig, TierStore
from tiermem.apps.demo import MarkovText
from tiermem.models import MoE, MoEConfig
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def train(args: argparse.Namespace, cfg: MoEConfig, offload: bool,
          reference: list[float] | None = None,
          log: Callable[[str], object] = lambda s: print(s, flush=True)
          ) -> tuple[list[float], list[int]]:
    """Train ``args.steps`` steps, logging a line as each finishes (beside ``reference``'s loss
    of the same step, when given); return the losses and the experts without tokens per step."""
    torch.manual_seed(0)
    model = MoE(cfg)
    data = MarkovText(cfg.vocab)
    if offload:
        store = TierStore(StoreConfig(gpu_bytes="256MiB", cpu_bytes="256MiB", nvme_bytes=0))
        opt = HybridAdam(model.parameters(), **HP, offload_fraction=args.offload_fraction)
        ctx = offload_activations(model.blocks, store=store, num_layers=cfg.n_layers - 1)
    else:
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
    losses, idle = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        idx, tgt = data.batch(step, args.batch, cfg.seq_len)
        if offload:
            with ctx:
                loss = model(idx, tgt)[1]
        else:
            loss = model(idx, tgt)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # experts without tokens keep grad None: skipped
        losses.append(loss.item())
        idle.append(sum(int((b.moe.tokens_per_expert == 0).sum()) for b in model.blocks))
        beside = f"  (without offload {reference[step]:.5f})" if reference else ""
        log(f"[{'offload' if offload else 'baseline'}] step {step + 1:3d}/{args.steps}  loss "
            f"{losses[-1]:.5f}{beside}" + (f"  experts without tokens: {idle[-1]}" if offload
                                           else "") + f"  ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
    if offload:
        state = opt.memory_bytes()
        log(f"tiermem: optimizer state {state['gpu']:,} B on the device, {state['cpu']:,} B "
            f"in the cpu tier; {ctx.stats()['put_bytes']:,} B of activations offloaded")
        opt.close()
        ctx.close()
        store.close()
    return losses, idle


def main(argv: list[str] | None = None) -> int:
    """Train with and without offload and compare; returns the exit code (0 agree, 1 differ)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--offload-fraction", type=float, default=1.0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    cfg = MoEConfig(n_layers=args.layers, d_model=args.d_model, n_heads=4, seq_len=args.seq,
                    vocab=args.vocab, n_experts=args.experts, top_k=args.top_k,
                    d_expert=2 * args.d_model)
    print(f"MoE: {cfg.num_params():,} parameters, {cfg.active_params():,} active per token "
          f"(top-{cfg.top_k} of {cfg.n_experts} experts in each of {cfg.n_layers} blocks)",
          flush=True)
    print("without offload: torch AdamW, nothing offloaded", flush=True)
    base, _ = train(args, cfg, offload=False)
    print(f"with tiermem: HybridAdam with {args.offload_fraction:.0%} of the optimizer state in "
          f"the cpu tier, activations of {cfg.n_layers - 1} of {cfg.n_layers} blocks offloaded",
          flush=True)
    off, idle = train(args, cfg, offload=True, reference=base)
    diff = max(abs(a - b) for a, b in zip(off, base))
    same = diff <= args.tolerance
    print(f"loss {off[0]:.4f} -> {off[-1]:.4f}; max |difference| with offload: {diff:.3g} "
          f"({'matches' if same else 'DIFFERS from'} the run without offload, tolerance "
          f"{args.tolerance:g})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
