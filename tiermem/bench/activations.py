"""``tiermem bench activations``: forward+backward time and peak memory, offload side by side.

All rows run in ONE process on the same model (:mod:`tiermem.bench._gpt`, bf16 on CUDA), so
they compare within a run:

- ``no offload``; ``checkpoint every block``;
- ``save_on_cpu(pin_memory=True)`` (torch's own offload; unpinned on a machine without CUDA);
- ``tiermem cpu N=...``: :func:`~tiermem.offload.offload_activations` of the first N blocks to
  pinned host memory, for N = all but the last and the values of ``--num-layers``;
- ``tiermem cpu auto``: ``layers="auto"``, the blocks whose copies hide behind compute, chosen
  after the second forward (needs ``--warmup`` >= 2 to time the chosen set only);
- ``tiermem cpu N=... double-buffered``;
- ``checkpoint + tiermem``: checkpointing every block and offloading the checkpointed block
  inputs of every block;
- with ``--nvme-dir``: the same two tiermem setups to NVMe.

A step is forward + backward with the loss (no optimizer); ``ms/step`` is the mean of
``--steps`` timed steps after ``--warmup`` steps; ``peak GiB`` is
``torch.cuda.max_memory_allocated`` over the timed steps (parameters and gradients included,
2^30 bytes); ``moved MiB`` the bytes (2^20) one step puts into the store. One store (pinned pool)
serves every tiermem row, so pinned allocation is paid in warm-up, as in training.

Usage::

    python -m tiermem.bench.activations --layers 24 --d-model 2048 --heads 16 --seq 2048 \\
        --batch 8 --vocab 32000 --steps 5
    python -m tiermem.bench.activations --layers 2 --d-model 64 --seq 32 --batch 2 --vocab 128
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tiermem.bench._gpt import GPT, GPTConfig
from tiermem.config import StoreConfig, parse_bytes
from tiermem.offload import default_store_config, offload_activations
from tiermem.store import TierStore


@dataclass
class Row:
    """One setup's result."""

    setup: str
    ms_per_step: float
    peak_bytes: int | None
    moved_bytes: int | None


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="tiermem bench activations", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=2048, help="model width")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (tokens)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch (sequences)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setup")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per setup (2: layers='auto' has chosen before timing)")
    p.add_argument("--num-layers", default=None,
                   help="comma-separated extra num_layers values (default: L/4, L/2, 3L/4)")
    p.add_argument("--prefetch-depth", type=int, default=1, help="layers reloaded ahead")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--nvme-dir", default=None, help="also run tiermem rows to NVMe spill files here")
    p.add_argument("--nvme-bytes", default="64GiB", help="nvme budget for --nvme-dir")
    p.add_argument("--cpu-bytes", default=None, help="host budget (default: half of MemAvailable)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run matching setups")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "prefetch_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    return args


def _setups(args, store: TierStore, nvme_store: TierStore | None) -> list[tuple[str, bool, Callable]]:
    """(name, checkpointing, context factory) for every row."""
    n = args.layers
    cuda = torch.cuda.is_available()
    rows: list[tuple[str, bool, Callable]] = [
        ("no offload", False, contextlib.nullcontext),
        ("checkpoint every block", True, contextlib.nullcontext),
        (f"save_on_cpu(pin_memory={cuda})", False,
         lambda m: torch.autograd.graph.save_on_cpu(pin_memory=cuda)),
    ]
    extra = ([int(x) for x in args.num_layers.split(",") if x] if args.num_layers is not None
             else sorted({n // 4, n // 2, 3 * n // 4} - {0, n - 1}))
    for k in sorted(set(extra) | {n - 1}, reverse=True):
        if not 0 <= k < n:
            raise ValueError(f"--num-layers value {k} is outside [0, {n})")
        rows.append((f"tiermem cpu N={k}" + (" (all but last)" if k == n - 1 else ""), False,
                     lambda m, k=k: offload_activations(m.blocks, store=store, num_layers=k,
                                                        prefetch_depth=args.prefetch_depth)))
    rows.append(("tiermem cpu auto", False,  # the label gets the chosen blocks after the run
                 lambda m: offload_activations(m.blocks, store=store, layers="auto",
                                               prefetch_depth=args.prefetch_depth)))
    rows.append((f"tiermem cpu N={n - 1} double-buffered", False,
                 lambda m: offload_activations(m.blocks, store=store, num_layers=n - 1,
                                               double_buffering=True)))
    rows.append(("checkpoint + tiermem cpu (all block inputs)", True,
                 lambda m: offload_activations(m.blocks, store=store, layers=range(n),
                                               prefetch_depth=args.prefetch_depth)))
    if nvme_store is not None:
        rows.append((f"tiermem nvme N={n - 1}", False,
                     lambda m: offload_activations(m.blocks, store=nvme_store, tier="nvme",
                                                   num_layers=n - 1,
                                                   prefetch_depth=args.prefetch_depth)))
        rows.append(("checkpoint + tiermem nvme (all block inputs)", True,
                     lambda m: offload_activations(m.blocks, store=nvme_store, tier="nvme",
                                                   layers=range(n),
                                                   prefetch_depth=args.prefetch_depth)))
    if args.only:
        keys = [s.strip() for s in args.only.split(",") if s.strip()]
        rows = [r for r in rows if r[0] == "no offload" or any(k in r[0] for k in keys)]
    return rows


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for k, run in itertools.groupby(enumerate(layers), key=lambda p: p[1] - p[0]):
        run = [b for _, b in run]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark timing only: the step must have finished


def run(args, log=print) -> list[Row]:
    """Run every setup and return its row."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    torch.manual_seed(0)
    model = GPT(cfg).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g).to(device)
    log(f"model: {cfg.num_params() / 1e9:.3f}B params, {dtype}, device {device}")
    base = default_store_config()
    if args.cpu_bytes is not None:
        base.cpu_bytes = parse_bytes(args.cpu_bytes, "--cpu-bytes")
    store = TierStore(base)
    nvme_store = None
    if args.nvme_dir:
        nvme_store = TierStore(StoreConfig(gpu_bytes=base.gpu_bytes, cpu_bytes=base.cpu_bytes,
                                           nvme_bytes=args.nvme_bytes, nvme_dir=args.nvme_dir,
                                           pool_slab_bytes=base.pool_slab_bytes))
    rows = []
    try:
        for name, ckpt, make_ctx in _setups(args, store, nvme_store):
            model.checkpoint = ckpt
            moved = None
            times = []
            ctx = make_ctx(model)  # entered once per step (double-buffer sets persist)
            for step in range(args.warmup + args.steps):
                if step == args.warmup and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                model.zero_grad(set_to_none=True)
                before = ctx.stats()["put_bytes"] if hasattr(ctx, "stats") else 0
                _sync(device)
                t0 = time.perf_counter()
                with ctx:
                    _, loss = model(idx, targets)
                    loss.backward()
                _sync(device)
                times.append(time.perf_counter() - t0)
                if hasattr(ctx, "stats"):
                    moved = ctx.stats()["put_bytes"] - before  # counters are cumulative
            ms = 1000 * sum(times[args.warmup:]) / args.steps
            plan = getattr(ctx, "plan", None)
            if plan is not None:  # layers="auto": say what it chose
                name = f"{name} ({len(plan['layers'])} blocks: {_spans(plan['layers'])})"
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            rows.append(Row(name, ms, peak, moved))
            log(f"  {name}: {ms:.1f} ms/step")
            model.zero_grad(set_to_none=True)
            gc.collect()
    finally:
        store.close()
        if nvme_store is not None:
            nvme_store.close()
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (x = ms/step relative to ``no offload``)."""
    ref = next((r.ms_per_step for r in rows if r.setup == "no offload"), None)
    width = max(len(r.setup) for r in rows)
    lines = [f"{'setup':<{width}}  {'ms/step':>9}  {'x':>6}  {'peak GiB':>8}  {'moved MiB':>9}"]
    for r in rows:
        x = f"{r.ms_per_step / ref:.2f}x" if ref else "-"
        peak = f"{r.peak_bytes / 2**30:.2f}" if r.peak_bytes is not None else "-"
        moved = f"{r.moved_bytes / 2**20:.2f}" if r.moved_bytes is not None else "-"
        lines.append(f"{r.setup:<{width}}  {r.ms_per_step:>9.1f}  {x:>6}  {peak:>8}  {moved:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0 ok, 2 bad input)."""
    try:
        args = _parse_args(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"tiermem bench activations: layers={args.layers} d_model={args.d_model} "
          f"heads={args.heads} seq={args.seq} batch={args.batch} vocab={args.vocab} "
          f"steps={args.steps} (mean ms/step after {args.warmup} warm-up)", flush=True)
    try:
        rows = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
