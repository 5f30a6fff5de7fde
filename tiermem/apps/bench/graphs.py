"""``tiermem bench graphs``: step time with the forward+backward replayed from a CUDA graph.

Five rows in one process, on the reference GPT (``tiermem.models.gpt``; by default 12 blocks of
width 1024, sequence 1024, micro-batch 4, bf16 parameters: a step short enough that kernel
launches matter). CUDA only: a graph records GPU kernels.

- ``eager + torch AdamW``: fp32 masters and torch fused AdamW on the GPU (the baseline of
  ``tiermem bench optim``); ``eager + torch AdamW (again: its noise)``: the same, run again;
- ``graphed + torch AdamW``: the model's forward with its loss, and their backward, recorded
  once by ``torch.cuda.make_graphed_callables`` and replayed every step;
- ``eager + HybridAdam f=F`` and ``graphed + HybridAdam f=F``: HybridAdam with
  ``offload_fraction=F`` (``--offload-fraction``) and ``param_sync="step"``, which graphs need:
  the replayed backward leaves the gradients to be accumulated eagerly, so HybridAdam's hooks
  run as without graphs, and ``step()`` runs outside the graph (Note [cuda graphs] in
  tiermem/_graphs.py). Both with ``placement="given"``: the same GPU/CPU split of the state in
  both rows, which ``"trace"`` would not give (Note [cuda graphs]).

Every row trains a new model from the same initial weights on the same batches (a different
one every step) for ``--warmup`` + ``--steps`` optimizer steps with real weight updates. Each
step is timed in two parts, each ended by a device synchronisation: ``fwd+bwd`` (the model
call and ``backward()``) and ``optim`` (``step()`` and ``zero_grad()``; HybridAdam's CPU side
starts during the backward, so ``optim`` is what is left of it). ``step ms`` is their sum; each
column is the median over ``--repeats`` runs of the run's median timed step, ``spread`` the
min-max of the runs' medians of ``step ms``. Recording the graphs is not timed.

Each row is compared with its ``against`` row: a graphed row with the same optimizer eager, an
eager row with the baseline. ``speed-up`` is the ``against`` row's ms divided by this row's
(fwd+bwd and step; above 1 is faster); ``parity`` compares the row's losses (every step, and the
final weights through one more batch) with the ``against`` row's first run, within 4x the
noise of the baseline run twice (:mod:`tiermem.apps.bench.parity`). Exit code: 0, 1 when a row did
not train as its ``against`` row, 2 on bad input or without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

from tiermem.apps import table
from tiermem.apps.bench.common import bench_device, bench_main, learnable_batches, sync
from tiermem.apps.bench.optim import HP, _GpuMasters
from tiermem.apps.bench.parity import NOISE_MULTIPLE, noise_of, verdict, worst_verdict
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.optim import HybridAdam

BASELINE = "eager + torch AdamW"
AGAIN = "eager + torch AdamW (again: its noise)"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Row:
    """One setup's result (times in ms; ``spread_ms`` the runs' min-max of ``step_ms``)."""

    setup: str
    fwd_bwd_ms: float
    optim_ms: float
    step_ms: float
    spread_ms: tuple[float, float]
    against: str
    fwd_bwd_speedup: float
    step_speedup: float
    parity: str
    losses: list[float]  # the first run's, every step and one batch after the last


class _LossOf(nn.Module):
    """The model's loss as the one output of a module (what is graphed: forward and loss)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(idx, targets)[1]


def _setups(fraction: float) -> list[tuple[str, str, bool, str]]:
    """(label, optimizer, graphed, against) of every row, in order."""
    eager_h = f"eager + HybridAdam f={fraction:g}"
    graphed_h = f"graphed + HybridAdam f={fraction:g}"
    return [(BASELINE, "adamw", False, BASELINE), (AGAIN, "adamw", False, BASELINE),
            ("graphed + torch AdamW", "adamw", True, BASELINE),
            (eager_h, "hybrid", False, BASELINE), (graphed_h, "hybrid", True, eager_h)]


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="tiermem bench graphs", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n", 1)[1].strip(),
                                formatter_class=_Formatter)
    p.add_argument("--layers", type=int, default=12, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=1024, help="model width")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (tokens)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch (sequences)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (tokens)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    p.add_argument("--offload-fraction", type=float, default=0.5,
                   help="HybridAdam's offload_fraction (share of the optimizer state on the CPU)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per run")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every row; each column is the median of the runs' medians")
    p.add_argument("--cpu-threads", type=int, default=None, help="threads of HybridAdam's CPU Adam")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model={args.d_model} must be divisible by --heads={args.heads} "
                         f"(each head is d_model / heads wide)")
    if not 0.0 <= args.offload_fraction <= 1.0:
        raise ValueError(f"--offload-fraction={args.offload_fraction} must be in [0, 1] (the "
                         f"share of the optimizer state HybridAdam keeps on the CPU)")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads={args.cpu_threads} must be >= 1 (or left out: the "
                         f"optimizer's default)")
    return args


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's paragraphs kept as written."""


def _require_cuda(args):
    """``args`` when CUDA is available.

    Raises:
        ValueError: no CUDA device, naming why and where the bench runs.
    """
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None
               else f"no GPU is visible (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        raise ValueError(f"tiermem bench graphs needs a CUDA device and {why}: CUDA graphs "
                         f"record GPU kernels; run it on a GPU machine (bash "
                         f"scripts/device_run.sh bench_graphs)")
    return args


def _config(args) -> GPTConfig:
    return GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                     seq_len=args.seq, vocab=args.vocab)


def _graph(module: nn.Module, sample: tuple[torch.Tensor, ...]) -> nn.Module:
    """``module`` with its forward and backward replayed from CUDA graphs recorded on
    ``sample``, which become the graphs' static inputs (every call copies its arguments into
    them, so they must not be a batch the caller uses again)."""
    return torch.cuda.make_graphed_callables(module, sample)


def _make_opt(kind: str, model: nn.Module, args):
    if kind == "adamw":
        return _GpuMasters(model.parameters())
    return HybridAdam(model.parameters(), **HP, offload_fraction=args.offload_fraction,
                      param_sync="step", placement="given", cpu_threads=args.cpu_threads)


def _train(kind: str, graphed: bool, init: dict, batches, args, device: torch.device):
    """One run of a row from ``init``: (fwd+bwd seconds, optim seconds) of each timed step and
    the losses (every step, then the final weights through the last batch)."""
    with torch.device(device):
        model = GPT(_config(args)).to(dtype=DTYPES[args.dtype])
    model.load_state_dict(init)
    opt = _make_opt(kind, model, args)  # before graphing, as tests/optim/test_hybrid_adam_graphs.py
    step_fn = _LossOf(model)
    if graphed:  # static inputs of their own: a replay copies each batch into them
        step_fn = _graph(step_fn, tuple(t.clone() for t in batches[0]))
    fwd_bwd_s, optim_s, losses = [], [], []
    for idx, targets in batches[:-1]:
        sync(device)
        t0 = time.perf_counter()
        loss = step_fn(idx, targets)
        loss.backward()
        sync(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync(device)
        fwd_bwd_s.append(t1 - t0)
        optim_s.append(time.perf_counter() - t1)
        losses.append(loss.detach().clone())  # a graph's output is overwritten by the next replay
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    with torch.no_grad():  # the final weights, seen eagerly through one more batch
        losses.append(model(*batches[-1])[1])
    out = fwd_bwd_s[args.warmup:], optim_s[args.warmup:], [float(x) for x in losses]
    if isinstance(opt, HybridAdam):
        opt.close()
    del step_fn, model, opt, loss
    gc.collect()  # a graphed module and its graphs' memory pool form a reference cycle
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args, log=print, device: torch.device | None = None) -> list[Row]:
    """Train every row ``args.repeats`` times on ``device`` (None: :func:`bench_device`) and
    return the rows with their times, speed-ups and parity verdicts.

    Raises:
        ValueError: HybridAdam refused an argument (e.g. ``--cpu-threads``).
        RuntimeError: torch could not record a CUDA graph (its message), or HybridAdam's CPU
            step failed.
    """
    device = device or bench_device()
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(_config(args)).to(dtype=DTYPES[args.dtype])
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    batches = learnable_batches(args.vocab, args.batch, args.seq,
                                args.warmup + args.steps + 1, device)  # + one after the last
    log(f"model: {_config(args).num_params() / 1e9:.3f}B params, {args.dtype}, device {device}")
    rows: dict[str, Row] = {}
    runs_of: dict[str, list[list[float]]] = {}
    noise = 0.0
    for label, kind, graphed, against in _setups(args.offload_fraction):
        fwd_bwd, optim, steps, runs = [], [], [], []
        for _ in range(args.repeats):
            fb, op, losses = _train(kind, graphed, init, batches, args, device)
            fwd_bwd.append(1e3 * statistics.median(fb))
            optim.append(1e3 * statistics.median(op))
            steps.append(1e3 * statistics.median(a + b for a, b in zip(fb, op)))
            runs.append(losses)
        runs_of[label] = runs
        if label == BASELINE:
            parity = "baseline"
        else:
            if label == AGAIN:  # the baseline's noise: every run against the first
                base = runs_of[BASELINE]
                noise = max(noise_of(base[0], r) for r in base[1:] + runs)
            parity = worst_verdict([verdict(r, runs_of[against][0], noise) for r in runs])
        fb_ms, step_ms = statistics.median(fwd_bwd), statistics.median(steps)
        ref = rows.get(against)
        rows[label] = Row(label, fb_ms, statistics.median(optim), step_ms,
                          (min(steps), max(steps)), against,
                          (ref.fwd_bwd_ms if ref else fb_ms) / fb_ms,
                          (ref.step_ms if ref else step_ms) / step_ms, parity, runs[0])
        log(f"  {label}: fwd+bwd {fb_ms:.1f} ms, step {step_ms:.1f} ms, {parity}")
    return list(rows.values())


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table (ms; speed-up = the ``against`` row's ms / this row's).

    Raises:
        nothing: no rows give the header line alone.
    """
    return table.render(
        [table.Column("setup", align="<"), table.Column("fwd+bwd ms", 10),
         table.Column("optim ms", 9), table.Column("step ms", 9), table.Column("spread", 13),
         table.Column("speed-up fwd+bwd", 16), table.Column("step", 6),
         table.Column("against", align="<"), table.PARITY],
        [(r.setup, f"{r.fwd_bwd_ms:.1f}", f"{r.optim_ms:.1f}", f"{r.step_ms:.1f}",
          table.spread(r.spread_ms), f"{r.fwd_bwd_speedup:.2f}x", f"{r.step_speedup:.2f}x",
          r.against, r.parity) for r in rows])


def _header(args) -> str:
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return (f"tiermem bench graphs: GPT {_config(args).num_params() / 1e9:.3f}B params "
            f"(layers={args.layers} d_model={args.d_model} heads={args.heads} seq={args.seq} "
            f"batch={args.batch} vocab={args.vocab}) {args.dtype} on {where}; HybridAdam "
            f"offload_fraction={args.offload_fraction:g}; median of {args.steps} steps after "
            f"{args.warmup} warm-up, {args.repeats} run(s)\n"
            f"speed-up: the 'against' row's ms / this row's; parity: losses against the "
            f"'against' row's, within {NOISE_MULTIPLE:g}x the baseline's run-to-run noise")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the exit code (0 ok, 1 a row's losses
    differ from its ``against`` row's, 2 bad input or no CUDA device, one line on stderr).

    Raises:
        SystemExit: from argparse: 0 after ``--help``, 2 for an unknown flag or a value that
            is not a number.
        RuntimeError: as :func:`run`.
    """
    return bench_main(argv, lambda a: _require_cuda(_parse_args(a)), _header, run, format_table,
                      lambda rows: [r.setup for r in rows if r.parity.startswith("WRONG")],
                      baseline="their 'against' row")


if __name__ == "__main__":
    sys.exit(main())
