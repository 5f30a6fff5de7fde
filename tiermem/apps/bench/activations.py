"""``tiermem bench activations``: forward+backward time and peak memory, offload side by side.

All rows run in ONE process on the same model (:mod:`tiermem.models.gpt`, bf16 on CUDA), so
they compare within a run:

- ``no offload``; ``checkpoint every block``;
- ``save_on_cpu(pin_memory=True)`` (torch's own offload; unpinned on a machine without CUDA);
- ``tiermem cpu N=...``: :func:`~tiermem.offload.offload_activations` of the first N blocks to
  pinned host memory, for N = all but the last and the values of ``--offload-layers``;
- ``tiermem cpu auto``: ``layers="auto"``, the blocks whose copies hide behind compute, chosen
  after the second forward (needs ``--warmup`` >= 2 to time the chosen set only);
- ``tiermem cpu N=... double-buffered``;
- ``checkpoint + tiermem``: checkpointing every block and offloading the checkpointed block
  inputs of every block;
- with ``--nvme-dir``: the same two tiermem setups to NVMe.

``--loss-chunk-tokens C`` builds the model with ``GPT(..., loss_chunk_tokens=C)`` for every row
(so the rows stay comparable): the head and the loss run in checkpointed chunks of at most C
tokens and no full logits tensor exists (Note [chunked loss] in tiermem/models/gpt.py).

Every setup trains the same model from the same initial weights on the same batches (a new
batch every step) for ``--warmup`` + ``--steps`` steps: forward + backward is timed, then an
AdamW step (not timed) changes the weights, so a stale or wrong reload changes the losses.
``ms/step`` is the median over ``--repeats`` runs of each run's median timed step, with the
spread (min-max of those run medians); ``peak GiB`` is ``torch.cuda.max_memory_allocated``
over the timed forward+backward windows of the last run, less the optimizer's state (the same
in every row): parameters, gradients and activations, 2^30 bytes;
``moved MiB`` the bytes (2^20) one step puts into the store; ``parity`` compares the setup's
losses (every step, and one more batch after the last) with the ``no offload`` run's, within
4x the noise of ``no offload`` run twice (:mod:`tiermem.apps.bench.parity`). One store (pinned
pool) serves every tiermem row, so pinned allocation is paid in warm-up, as in training.
Without CUDA the defaults are a CPU-sized model (4 blocks of width 128).

Usage::

    python -m tiermem.apps.bench.activations --layers 24 --d-model 2048 --heads 16 --seq 2048 \\
        --batch 8 --vocab 32000 --steps 5
    python -m tiermem.apps.bench.activations --layers 2 --d-model 64 --seq 32 --batch 2 --vocab 128
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tiermem.models.gpt import GPT, GPTConfig
from tiermem.apps import table
from tiermem.apps.bench.common import bench_device, bench_main, learnable_batches, sync
from tiermem.names import gib, mib
from tiermem.apps.bench.parity import BaselineParity
from tiermem.config import StoreConfig, parse_bytes
from tiermem import flags
from tiermem.offload import default_store_config, offload_activations
from tiermem.store import TierStore


_AGAIN = "no offload (again: its noise)"
_LR = 1e-3  # AdamW between the timed steps: the weights change every step


@dataclass
class Row:
    """One setup's result (times in ms, bytes in bytes)."""

    setup: str
    ms_per_step: float
    peak_bytes: int | None
    moved_bytes: int | None
    spread_ms: tuple[float, float] = (0.0, 0.0)
    parity: str = ""
    losses: list[float] | None = None  # the first run's, each step and one batch after


def _parse_args(argv):
    big = torch.cuda.is_available()  # the reference GPT on a GPU; a CPU-sized model otherwise
    p = argparse.ArgumentParser(prog="tiermem bench activations",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=24 if big else 4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=2048 if big else 128, help="model width")
    p.add_argument("--heads", type=int, default=16 if big else 4, help="attention heads")
    p.add_argument("--seq", type=int, default=2048 if big else 128, help="sequence length (tokens)")
    p.add_argument("--batch", type=int, default=8 if big else 2, help="micro-batch (sequences)")
    p.add_argument("--vocab", type=int, default=32000 if big else 512, help="vocabulary size")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setup")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every setup; ms/step is the median of the runs' medians")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per setup (2: layers='auto' has chosen before timing)")
    flags.add(p, "bench activations", "--offload-layers", dest="num_layers", default=None,
              help="comma-separated extra num_layers values (default: L/4, L/2, 3L/4)")
    p.add_argument("--prefetch-depth", type=int, default=1, help="layers reloaded ahead")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--nvme-dir", default=None, help="also run tiermem rows to NVMe spill files here")
    p.add_argument("--nvme-bytes", default="64GiB", help="nvme budget for --nvme-dir")
    p.add_argument("--cpu-bytes", default=None, help="host budget (default: half of MemAvailable)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run matching setups")
    p.add_argument("--loss-chunk-tokens", type=int, default=None,
                   help="tokens per checkpointed loss chunk in every row (default: off, the loss "
                        "on the full logits)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "repeats",
                 "prefetch_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 1:
        raise ValueError(f"--loss-chunk-tokens={args.loss_chunk_tokens} must be >= 1; leave it "
                         f"out for the loss on the full logits")
    return args


def _setups(args, store: TierStore, nvme_store: TierStore | None) -> list[tuple[str, bool, Callable]]:
    """(name, checkpointing, context factory) for every row."""
    n = args.layers
    cuda = torch.cuda.is_available()
    rows: list[tuple[str, bool, Callable]] = [
        ("no offload", False, contextlib.nullcontext),
        (_AGAIN, False, contextlib.nullcontext),  # the baseline's run-to-run noise
        ("checkpoint every block", True, contextlib.nullcontext),
        (f"save_on_cpu(pin_memory={cuda})", False,
         lambda m: torch.autograd.graph.save_on_cpu(pin_memory=cuda)),
    ]
    extra = ([int(x) for x in args.num_layers.split(",") if x] if args.num_layers is not None
             else sorted({n // 4, n // 2, 3 * n // 4} - {0, n - 1}))
    for k in sorted(set(extra) | {n - 1}, reverse=True):
        if not 0 <= k < n:
            raise ValueError(f"--offload-layers value {k} is outside [0, {n})")
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
        rows = [r for r in rows if r[0].startswith("no offload") or any(k in r[0] for k in keys)]
    return rows


def _spans(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for k, run in itertools.groupby(enumerate(layers), key=lambda p: p[1] - p[0]):
        run = [b for _, b in run]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out) or "none"


def _train(model, init: dict, make_ctx: Callable, batches, args, device,
           on_step: Callable[[int, int], None] | None = None) -> tuple:
    """One run of a setup from ``init``: (timed step seconds, losses, moved bytes, context,
    peak device bytes of the timed fwd+bwd windows without the optimizer's state).
    ``on_step(done, total)`` is called after each step (progress lines)."""
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=0.1)
    ctx = make_ctx(model)  # entered once per step (double-buffer sets persist)
    times, losses, moved, peak = [], [], None, None
    for step, (idx, targets) in enumerate(batches[:-1]):
        before = ctx.stats()["put_bytes"] if hasattr(ctx, "stats") else 0
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the fwd+bwd window only
        t0 = time.perf_counter()
        with ctx:
            _, loss = model(idx, targets)
            loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        if device.type == "cuda" and step >= args.warmup:  # the optimizer's state excluded
            state = sum(t.nbytes for st in opt.state.values() for t in st.values()
                        if torch.is_tensor(t) and t.device == device)
            peak = max(peak or 0, torch.cuda.max_memory_allocated(device) - state)
        if hasattr(ctx, "stats"):
            moved = ctx.stats()["put_bytes"] - before  # counters are cumulative
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step + 1, len(batches) - 1)
    with torch.no_grad():  # the final weights, seen through one more batch
        losses.append(model(*batches[-1])[1])
    return times[args.warmup:], [float(x) for x in losses], moved, ctx, peak


HEARTBEAT_S = 10.0
"""Longest silence (seconds) inside a setup: a progress line at the first step after it."""


def run(args, log=print) -> list[Row]:
    """Run every setup ``args.repeats`` times and return its row (with its parity verdict).
    Progress goes to ``log`` as it happens: a line per setup, per run when there are several,
    and one at least every :data:`HEARTBEAT_S` seconds within a run (a row can take minutes on
    a CPU)."""
    said = [time.monotonic()]  # when the last line was logged
    outer_log = log

    def log(line: str) -> None:  # noqa: F811 - the same log, remembering when it spoke
        outer_log(line)
        said[0] = time.monotonic()

    def heartbeat(name: str, rep: int) -> Callable[[int, int], None]:
        def on_step(done: int, total: int) -> None:
            if time.monotonic() - said[0] >= HEARTBEAT_S:
                log(f"  {name}: run {rep}/{args.repeats}, step {done}/{total} ...")
        return on_step

    device = bench_device()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg, loss_chunk_tokens=args.loss_chunk_tokens).to(dtype=dtype)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    batches = learnable_batches(cfg.vocab, args.batch, args.seq,
                                args.warmup + args.steps + 1, device)  # + one after the last
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
    rows: list[Row] = []
    parities = BaselineParity("no offload", _AGAIN)
    try:
        for name, ckpt, make_ctx in _setups(args, store, nvme_store):
            model.checkpoint = ckpt
            medians, runs = [], []
            for rep in range(1, args.repeats + 1):
                times, losses, moved, ctx, peak = _train(model, init, make_ctx, batches, args,
                                                         device, heartbeat(name, rep))
                medians.append(1e3 * statistics.median(times))
                runs.append(losses)
                if args.repeats > 1:
                    log(f"  {name}: run {rep}/{args.repeats}: {medians[-1]:.1f} ms/step")
            parity = parities.of(name, runs)
            plan = getattr(ctx, "plan", None)
            if plan is not None:  # layers="auto": say what it chose, and from what
                name = f"{name} ({len(plan['layers'])} blocks: {_spans(plan['layers'])})"
                log(f"  auto's inputs (last run): block forward ms "
                    f"{statistics.median(plan['fwd_ms']):.2f} (median of {len(plan['fwd_ms'])}, "
                    f"sum {sum(plan['fwd_ms']):.1f}), saved MiB per block "
                    f"{statistics.median(plan['nbytes']) / 2**20:.0f}, d2h {plan['d2h_gbps']:.1f} "
                    f"/ h2d {plan['h2d_gbps']:.1f} GB/s, host ms to issue a block "
                    f"{statistics.median(plan['host_ms']):.2f}, host ms to offload a block "
                    f"{statistics.median(plan['offload_host_ms'][:-1] or [0.0]):.2f}, predicted "
                    f"stall {plan['predicted_stall_ms']:.1f} ms")
            rows.append(Row(name, statistics.median(medians), peak, moved,
                            (min(medians), max(medians)), parity, runs[0]))
            log(f"  {name}: {rows[-1].ms_per_step:.1f} ms/step, {parity}")
            gc.collect()
    finally:
        store.close()
        if nvme_store is not None:
            nvme_store.close()
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (x = ms/step relative to ``no offload``; spread = the
    runs' min-max; parity = losses against ``no offload``)."""
    ref = next((r.ms_per_step for r in rows if r.setup == "no offload"), None)
    return table.render(
        [table.Column("setup", align="<"), table.Column("ms/step", 9), table.Column("spread", 13),
         table.Column("x", 6), table.Column("peak GiB", 8), table.Column("moved MiB", 9),
         table.PARITY],
        [(r.setup, f"{r.ms_per_step:.1f}", table.spread(r.spread_ms),
          table.ratio(r.ms_per_step, ref), gib(r.peak_bytes), mib(r.moved_bytes), r.parity)
         for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0 ok, 1 a setup's losses
    differ from the baseline's, 2 bad input)."""
    return bench_main(
        argv, _parse_args,
        lambda a: (f"tiermem bench activations: layers={a.layers} d_model={a.d_model} "
                   f"heads={a.heads} seq={a.seq} batch={a.batch} vocab={a.vocab} "
                   f"loss_chunk_tokens={a.loss_chunk_tokens or 'off'} steps={a.steps} "
                   f"repeats={a.repeats} (median ms/step after {a.warmup} warm-up)"),
        run, format_table, lambda rows: [r.setup for r in rows if r.parity.startswith("WRONG")])


if __name__ == "__main__":
    sys.exit(main())
