"""The same offloading on a Hugging Face ``transformers`` causal LM (optional extra ``[hf]``).

A Llama-style model is built from a config (no weights are downloaded) and trained on a
deterministic synthetic token stream twice from the same init: with tiermem (the saved
activations of all decoder layers but the last go to the store's cpu tier and come back,
prefetched, in backward; HybridAdam keeps ``--offload-fraction`` of the optimizer state in
pinned RAM and steps it on the CPU) and without (torch fused AdamW). It prints each step's loss
as the step finishes (the tiermem run's beside the baseline's), the store's traffic per step and
the largest loss difference, and exits 1 if that exceeds ``--tolerance``.

    pip install -e ".[hf]"
    python examples/hf_model.py --steps 10                 # CPU: a tiny model, fp32, exact
    python examples/hf_model.py --device cuda --hidden 1024 --layers 8 --tolerance 1e-2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tiermem import StoreConfig, TierStore
from tiermem.names import check_device, resolve_device
from tiermem.offload import offload_activations
from tiermem.optim import HybridAdam

HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A LlamaForCausalLM from a config, seeded, on ``device`` (fp32 on CPU, bf16 on CUDA).

    Raises:
        SystemExit: transformers is not installed (exit code 2, with the install command).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("hf_model: transformers is not installed; pip install -e '.[hf]'", file=sys.stderr)
        raise SystemExit(2) from None
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def batches(args: argparse.Namespace, device: torch.device):
    """``args.steps`` deterministic batches of ``(batch, seq)`` token ids: two batches in turn,
    so the loss visibly falls as the model memorises them."""
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1 + step % 2)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        yield ids.to(device)


def train(args: argparse.Namespace, device: torch.device, offload: bool,
          reference: list[float] | None = None, log=lambda s: print(s, flush=True)
          ) -> list[float]:
    """Train ``args.steps`` steps, logging each step's loss as it finishes (beside
    ``reference``'s, when given); return the losses."""
    model = build(args, device)
    layers = model.model.layers
    store = None
    if offload:
        store = TierStore(StoreConfig(gpu_bytes="64GiB" if device.type == "cuda" else "1GiB",
                                      cpu_bytes="8GiB" if device.type == "cuda" else "1GiB",
                                      device=str(device)))
        opt = HybridAdam(model.parameters(), **HP, offload_fraction=args.offload_fraction)
        ctx = offload_activations(layers, store=store, tier="cpu",
                                  num_layers=len(layers) - 1, prefetch_depth=1)
    else:
        opt = torch.optim.AdamW(model.parameters(), **HP, fused=True)
        ctx = None
    losses = []
    t0 = time.perf_counter()
    for step, ids in enumerate(batches(args, device)):
        if ctx is not None:
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        beside = f"  (baseline {reference[step]:.6f})" if reference else ""
        log(f"[{'tiermem' if offload else 'baseline'}] step {step + 1:>3}/{args.steps}  loss "
            f"{losses[-1]:.6f}{beside}  ({time.perf_counter() - t0:.1f} s)")
        t0 = time.perf_counter()
    if offload:
        opt.close()
        log(describe_traffic(store.stats()["moved_bytes"], args.steps, device))
        store.close()
    return losses


def describe_traffic(moved_bytes: dict, steps: int, device: torch.device) -> str:
    """One readable line for a store's ``moved_bytes`` (``{"cpu->gpu": n, "gpu->cpu": n, ...}``):
    MiB per step for each direction, e.g. ``store traffic per step: gpu->cpu 2.0 MiB, cpu->gpu
    2.0 MiB``. Without CUDA the store's "gpu" tier is host memory (a put into the cpu tier
    copies nothing), which the line says."""
    parts = [f"{d} {n / steps / 2**20:.1f} MiB" for d, n in sorted(moved_bytes.items())]
    note = "" if device.type == "cuda" else " (no CUDA: the 'gpu' tier is host memory)"
    return "  store traffic per step: " + (", ".join(parts) or "none") + note


def main(argv: list[str] | None = None) -> int:
    """Run both trainings and compare; returns the exit code (0 agree, 1 differ, 2 usage)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--offload-fraction", type=float, default=1.0)
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args(argv)
    try:  # before anything is built: a 7B preset on a machine without CUDA is one line
        device = resolve_device(check_device("", "--device", args.device), "--device")
    except ValueError as exc:
        print(f"hf_model: error: {exc}", file=sys.stderr)
        return 2
    print(f"model: LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, {args.heads} "
          f"heads, vocab {args.vocab}; {args.steps} steps of {args.batch} x {args.seq} tokens on "
          f"{device}", flush=True)
    print("baseline: torch.optim.AdamW(fused=True), nothing offloaded", flush=True)
    base = train(args, device, offload=False)
    print(f"tiermem: HybridAdam with {args.offload_fraction:.0%} of the optimizer state in host "
          f"RAM (pinned with CUDA), activations of {args.layers - 1} of {args.layers} layers -> "
          f"the store's cpu tier", flush=True)
    off = train(args, device, offload=True, reference=base)
    diff = max(abs(a - b) for a, b in zip(off, base))
    verdict = "OK" if diff <= args.tolerance else "FAILED"
    print(f"max |loss difference|: {diff:.3g} (tolerance {args.tolerance:g}): {verdict}")
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
