"""``tiermem bench lora``: a LoRA fine-tune's step time and peak memory, offload side by side.

The model is :func:`tiermem.models.lora_llama.lora_llama` (a transformers Llama from a config,
peft LoRA on every attention and MLP projection, frozen base; Llama-2-7B's shape in bf16 on
CUDA, the tiny preset in fp32 without CUDA), built once. At each sequence length of
``--seqs`` every setup trains it from the same initial adapters on the same batches (a new
batch every step) for ``--warmup`` + ``--steps`` steps, with the same optimizer on the adapters
(``--optimizer``: HybridAdam, state in pinned RAM, or torch's fused AdamW):

- ``no offload``, and ``no offload (again: its noise)``;
- ``checkpointing``: transformers' activation checkpointing of every decoder layer;
- ``offload``: :func:`~tiermem.offload.offload_activations` of all decoder layers but the last
  to pinned RAM (the adapters' saved tensors are inside the layers, so they go too);
- ``checkpointing + offload``: every layer checkpointed and its checkpointed input offloaded;
- ``offload adapter tensors``: tensor-level offload of what the adapters alone save
  (:func:`~tiermem.offload.offload_in_modules` over every ``lora_A`` / ``lora_B``), nothing else.

``ms/step`` is the median over ``--repeats`` runs of each run's median timed step (forward,
backward, optimizer step), with the spread (min-max of those run medians); ``peak GiB`` is
``torch.cuda.max_memory_allocated`` over the timed steps of the last run (weights, adapters,
gradients, activations, optimizer state: everything on the GPU; 2^30 bytes; ``-`` without
CUDA); ``moved MiB`` the activation bytes (2^20) one step puts into the store; ``parity``
compares the setup's losses (every step, and one more batch after the last) with the ``no
offload`` run's, within 4x the noise of ``no offload`` run twice (:mod:`tiermem.apps.bench.parity`).
Needs the ``[lora]`` extra (transformers, peft).

Usage::

    tiermem bench lora                                     # CUDA: 7b preset, seq 2048 and 8192
    tiermem bench lora --seqs 32,64 --steps 2 --warmup 1   # CPU: the tiny preset
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from tiermem.apps import table
from tiermem.apps.bench.common import bench_device, bench_main, sync
from tiermem.names import gib, mib
from tiermem.apps.bench.parity import BaselineParity
from tiermem.models.lora_llama import (SHAPES, adapter_parameters, decoder_layers, lora_batches,
                                       lora_llama, lora_modules, set_checkpointing)
from tiermem.offload import default_store_config, offload_activations, offload_in_modules
from tiermem.optim import HybridAdam
from tiermem.store import TierStore

HP = dict(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
_AGAIN = "no offload (again: its noise)"
# (name, checkpointing, offload: None, "layers" (offload_activations of the decoder layers) or
# "adapters" (offload_in_modules over the lora_A / lora_B Linears)): the rows of every sequence
# length, in order
SETUPS = (("no offload", False, None), (_AGAIN, False, None), ("checkpointing", True, None),
          ("offload", False, "layers"), ("checkpointing + offload", True, "layers"),
          ("offload adapter tensors", False, "adapters"))


@dataclass
class Row:
    """One setup at one sequence length (times in ms, bytes in bytes)."""

    seq: int
    setup: str
    ms_per_step: float
    spread_ms: tuple[float, float]
    peak_bytes: int | None
    moved_bytes: int | None
    parity: str = ""


def _parse_args(argv):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="tiermem bench lora", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(SHAPES), default="7b" if cuda else "tiny",
                   help="model shape (tiermem.models.lora_llama.SHAPES)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers instead of the preset's (a shorter model, same width)")
    p.add_argument("--seqs", default="2048,8192" if cuda else "32,64",
                   help="comma-separated sequence lengths (tokens)")
    p.add_argument("--batch", type=int, default=1 if cuda else 2, help="sequences per step")
    p.add_argument("--rank", type=int, default=16 if cuda else 8, help="LoRA rank")
    p.add_argument("--optimizer", choices=("hybrid", "adamw"), default="hybrid",
                   help="on the adapters in every row: HybridAdam (state in pinned RAM) or "
                        "torch fused AdamW")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of every setup; ms/step is the median of the runs' medians")
    args = p.parse_args(argv)
    for name in ("batch", "rank", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.layers is not None and args.layers < 2:
        raise ValueError(f"--layers={args.layers} must be >= 2 (offload keeps the last layer)")
    try:
        args.seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seqs={args.seqs!r} must be comma-separated integers, e.g. "
                         f"2048,8192") from None
    if not args.seqs or min(args.seqs) < 2:
        raise ValueError(f"--seqs={args.seqs} needs lengths >= 2 tokens, e.g. 2048,8192")
    return args


def _optimizer(model, name: str) -> torch.optim.Optimizer:
    params = adapter_parameters(model)
    if name == "hybrid":
        return HybridAdam(params, **HP, offload_fraction=1.0)
    return torch.optim.AdamW(params, **HP, fused=True)


def _run(model, init: list[torch.Tensor], batches: list[torch.Tensor], args, ckpt: bool,
         offload: str | None, store: TierStore
         ) -> tuple[list[float], list[float], int | None, int | None]:
    """One run from the initial adapters (checkpointing already set to ``ckpt``; ``offload`` as
    in :data:`SETUPS`): (losses, timed step seconds, peak bytes, activation bytes put per
    step)."""
    device = batches[0].device
    with torch.no_grad():
        for p, v in zip(adapter_parameters(model), init):
            p.copy_(v)
    opt = _optimizer(model, args.optimizer)
    layers = decoder_layers(model)
    ctx, regions = contextlib.nullcontext(), None
    if offload == "layers":
        chosen = range(len(layers)) if ckpt else range(len(layers) - 1)
        ctx = offload_activations(layers, store=store, layers=chosen)
    elif offload == "adapters":  # entered by hooks around every adapter call
        regions = offload_in_modules(lora_modules(model), store=store)
    times, losses, peak = [], [], None
    try:
        for step, ids in enumerate(batches[:-1]):
            if step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)  # the timed steps only
            sync(device)
            t0 = time.perf_counter()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach())
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        if isinstance(opt, HybridAdam):
            opt.synchronize()
        with torch.no_grad():  # the final adapters, seen through one more batch
            losses.append(model(input_ids=batches[-1], labels=batches[-1]).loss)
        counted = regions if regions is not None else ctx if offload else None
        moved = counted.stats()["put_bytes"] // len(times) if counted is not None else None
    finally:
        if isinstance(opt, HybridAdam):
            opt.close()
        if offload == "layers":
            ctx.close()
        if regions is not None:
            regions.close()
    return [float(x) for x in losses], times[args.warmup:], peak, moved


def run(args, log=print) -> list[Row]:
    """Every setup at every sequence length, ``args.repeats`` times; the rows with verdicts.

    Raises:
        ImportError: transformers or peft is missing.
    """
    device = bench_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.preset]
    if args.layers is not None:
        shape = dataclasses.replace(shape, layers=args.layers)
    model = lora_llama(shape, device=device, dtype=dtype, rank=args.rank, alpha=2 * args.rank,
                       max_seq=max(args.seqs))
    init = [p.detach().clone() for p in adapter_parameters(model)]
    total = sum(p.numel() for p in model.parameters())
    log(f"model: {total / 1e6:.1f}M params ({shape.layers} layers, hidden {shape.hidden}), "
        f"base {dtype} frozen, {sum(p.numel() for p in init) / 1e6:.2f}M adapter params "
        f"(rank {args.rank}); optimizer {args.optimizer}; device {device}")
    store = TierStore(default_store_config())
    rows: list[Row] = []
    try:
        for seq in args.seqs:
            batches = lora_batches(shape.vocab, args.batch, seq, args.warmup + args.steps + 1,
                                   device)
            parities = BaselineParity("no offload", _AGAIN)  # at each sequence length
            for name, ckpt, offload in SETUPS:
                set_checkpointing(model, ckpt)
                medians, runs, peak, moved = [], [], None, None
                for _ in range(args.repeats):
                    losses, times, peak, moved = _run(model, init, batches, args, ckpt,
                                                     offload, store)
                    medians.append(1e3 * statistics.median(times))
                    runs.append(losses)
                parity = parities.of(name, runs)
                rows.append(Row(seq, name, statistics.median(medians),
                                (min(medians), max(medians)), peak, moved, parity))
                log(f"  seq {seq} {name}: {rows[-1].ms_per_step:.1f} ms/step, {parity}")
                gc.collect()
            set_checkpointing(model, False)
    finally:
        store.close()
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (x = ms/step relative to ``no offload`` at the same
    sequence length; spread = the runs' min-max)."""
    ref = {r.seq: r.ms_per_step for r in rows if r.setup == "no offload"}
    return table.render(
        [table.Column("seq", 6), table.Column("setup", align="<"), table.Column("ms/step", 9),
         table.Column("spread", 15), table.Column("x", 6), table.Column("peak GiB", 8),
         table.Column("moved MiB", 9), table.PARITY],
        [(str(r.seq), r.setup, f"{r.ms_per_step:.1f}", table.spread(r.spread_ms),
          table.ratio(r.ms_per_step, ref.get(r.seq)), gib(r.peak_bytes), mib(r.moved_bytes),
          r.parity) for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0 ok, 1 a setup's losses
    differ from the baseline's, 2 bad input or transformers/peft missing)."""
    return bench_main(
        argv, _parse_args,
        lambda a: (f"tiermem bench lora: preset={a.preset} layers={a.layers or 'preset'} "
                   f"seqs={','.join(map(str, a.seqs))} batch={a.batch} rank={a.rank} "
                   f"optimizer={a.optimizer} steps={a.steps} repeats={a.repeats} (median "
                   f"ms/step after {a.warmup} warm-up)"),
        run, format_table,
        lambda rows: [f"{r.setup} (seq {r.seq})" for r in rows if r.parity.startswith("WRONG")],
        errors=(ImportError,))


if __name__ == "__main__":
    sys.exit(main())
