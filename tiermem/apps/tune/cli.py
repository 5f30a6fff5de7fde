"""``tiermem tune``: argument parsing, the demo grid and :func:`main` (a GPT, small by default,
the reference GPT with ``--layers 24 --d-model 2048 ...``; activation offload and HybridAdam over
prefetch depth, offloaded layers, optimizer offload fraction, state tier, store policy, the trace
policy's lookahead and the activation store's gpu budget: below ``prefetch depth + 1`` blocks'
worth of activations, prefetches must evict, which is where the ``lru`` and ``trace`` policies
differ)."""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiermem import flags, options
from tiermem.names import OFFLOAD_TIERS, POLICIES, check_choice
from tiermem.apps.tune.cost import CostModel
from tiermem.names import mib
from tiermem.apps.tune.runner import tune
from tiermem.apps.tune.workload import act_gpu_bytes, gpt_factory


def _layer_count(text: str) -> int | str:
    """``"auto"`` or an int (``--offload-layers`` values)."""
    return "auto" if text.strip() == "auto" else int(text)


def _csv(kind: Callable[[str], Any], name: str) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name}: {text!r} is not a comma-separated list") \
                from None
    return parse


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tiermem tune", description="Time a grid of offload settings on a small GPT "
        "(activation offload + HybridAdam), predict each from a cost model, and mark the "
        "fastest setting that fits the budgets.")
    g = p.add_argument_group("model (defaults: a tiny GPT that runs on a CPU in seconds)")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    g.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    g.add_argument("--seq", type=int, default=64, help="sequence length in tokens (default 64)")
    g.add_argument("--batch", type=int, default=4, help="micro-batch in sequences (default 4)")
    g.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    g = p.add_argument_group("grid (comma-separated values)")
    add = functools.partial(flags.add, g, "tune")  # default and field: tiermem/flags.py
    add("--prefetch-depth", type=_csv(int, "prefetch-depth"),
        help="activation layers reloaded ahead (default %(default)s)")
    add("--offload-layers", dest="num_layers", type=_csv(_layer_count, "offload-layers"),
        help="blocks whose activations are offloaded, or auto (chosen by measured compute vs "
             "transfer; default 0,L-1)")
    add("--offload-fraction", type=_csv(float, "offload-fraction"),
        help="HybridAdam offload_fraction (default %(default)s)")
    add("--state-tier", type=_csv(str, "state-tier"),
        help="HybridAdam state tier: cpu,nvme (default %(default)s)")
    add("--policy", type=_csv(str, "policy"),
        help="activation store policy: lru,trace (default %(default)s)")
    add("--prefetch-lookahead", type=_csv(int, "prefetch-lookahead"),
        help="accesses the trace policy prefetches ahead along its recording (trace settings "
             "only; default %(default)s)")
    g.add_argument("--act-gpu-budget", type=_csv(str, "act-gpu-budget"), default=None,
                   help="activation store gpu budget: blocks' worth of saved activations (1.5) "
                   "or bytes (3GiB); below prefetch depth + 1 blocks prefetches evict, which is "
                   "where lru and trace differ (default: room for everything, no eviction)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (default 3)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps per setting; the trace policy records in them (default 2)")
    flags.add(p, "tune", "--gpu-bytes", metavar="SIZE",
              help="device byte budget, e.g. 40GiB (default: 3/4 of the no-offload need)")
    flags.add(p, "tune", "--host-bytes", metavar="SIZE", help="host byte budget (default: none)")
    p.add_argument("--nvme-dir", default=None, help="spill directory (default: a temporary one)")
    p.add_argument("--overlap", action="store_true",
                   help="predict with perfect overlap instead of serial sums")
    p.add_argument("--no-model", action="store_true", help="skip the cost-model measurement")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype (default: bf16 on CUDA, fp32 on CPU)")
    flags.add(p, "tune", "--cpu-threads", type=int,
              help="HybridAdam CPU threads (default: all on CUDA, 1 on CPU)")
    p.add_argument("--telemetry-dir", default=None,
                   help="record each setting's last timed step (activation store) and write "
                   "there trace.json (Chrome trace, all settings), timeline.png (memory per tier "
                   "and transfers, settings side by side) and tune.json (the results)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    check = functools.partial(_check, args)  # each value as its field (tiermem/options.py)
    check("--cpu-threads", args.cpu_threads)
    for name in ("offload_fraction", "prefetch_depth", "prefetch_lookahead"):
        for value in getattr(args, name):
            check(f"--{name.replace('_', '-')}", value)
    for value in args.num_layers or ():
        if value != "auto":
            check("--offload-layers", value)
    for name in ("gpu_bytes", "host_bytes"):
        if getattr(args, name) is not None:
            check(f"--{name.replace('_', '-')}", getattr(args, name))
    for value in args.act_gpu_budget or ():
        act_gpu_bytes(value, 1)  # raises for a value that is neither blocks nor bytes
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    for t in args.state_tier:  # the grid's tiers: split needs a store the trials do not make
        check("--state-tier", t)
        check_choice("", "--state-tier", t, OFFLOAD_TIERS)
    for pol in args.policy:
        check("--policy", pol)
        check_choice("", "--policy", pol, POLICIES)
    return args


def _check(args: argparse.Namespace, flag: str, value: Any) -> Any:
    """One value of ``flag`` checked as the configuration field it sets (tiermem/flags.py),
    named by the flag.

    Raises:
        ValueError, TypeError: a bad value.
    """
    return flags.field_of("tune", flag)(options.Who(""), value, "tune", flag)


def demo_grid(args: argparse.Namespace) -> list[dict]:
    """Return the demo's settings without redundant points (state tier of an empty offload,
    prefetch depth without offloaded layers)."""
    layers = args.num_layers if args.num_layers is not None else sorted({0, args.layers - 1})
    budgets = getattr(args, "act_gpu_budget", None) or [None]
    lookaheads = getattr(args, "prefetch_lookahead", None) or [16]
    out, seen = [], set()
    for pol, n, d, f, t, b, la in itertools.product(
            args.policy, layers, args.prefetch_depth, args.offload_fraction, args.state_tier,
            budgets, lookaheads):
        s = dict(policy=pol, num_layers=n, prefetch_depth=d if n else args.prefetch_depth[0],
                 offload_fraction=f, state_tier=t if f > 0 else args.state_tier[0])
        if b is not None:
            s["act_gpu_budget"] = b if n else budgets[0]
        if pol == "trace":
            s["prefetch_lookahead"] = la
        key = tuple(sorted(s.items()))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out



def main(argv: Sequence[str] | None = None) -> int:
    """``tiermem tune``: run the GPT demo grid; return 0, or 1 when no setting fits.

    Raises:
        ValueError: bad arguments (the CLI prints them as one line, exit code 2).
    """
    from tiermem.models.gpt import GPTConfig

    args = _parse_args(sys.argv[1:] if argv is None else list(argv))
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or
                                                            ("bf16" if cuda else "fp32")]
    with tempfile.TemporaryDirectory(dir=args.nvme_dir, prefix="tiermem-tune-") as nvme_dir:
        factory = gpt_factory(cfg, args.batch, device, nvme_dir, dtype=dtype,
                              cpu_threads=args.cpu_threads if args.cpu_threads or cuda else 1)
        budgets: dict[str, int | str] = {}
        if args.gpu_bytes is not None:
            budgets["gpu"] = args.gpu_bytes
        else:  # params, grads, fp32 Adam state and all activations on the device, times 3/4
            need = 0
            if not cuda:  # on CUDA the trial reads no estimate: skip building one
                probe = factory(dict(num_layers=0))
                try:
                    need = probe.device_peak_bytes()
                finally:
                    probe.close()
            budgets["gpu"] = int(0.75 * max(need, 16 * cfg.num_params()))
        if args.host_bytes is not None:
            budgets["cpu"] = args.host_bytes
        model = None if args.no_model else CostModel.measure(device, nbytes=8 << 20,
                                                             nvme_dir=nvme_dir,
                                                             adam_params=1 << 18)
        settings = demo_grid(args)
        print(f"tiermem tune: GPT {cfg.n_layers}x{cfg.d_model}, {cfg.num_params() / 1e6:.2f}M "
              f"params ({str(dtype).removeprefix('torch.')}), batch {args.batch}x{cfg.seq_len} on "
              f"{device}; {len(settings)} settings x {args.steps} steps; saved activations "
              f"{mib(factory.saved_bytes, 1)} MiB per step, {mib(factory.block_bytes, 1)} MiB per "
              f"block", flush=True)
        if model is not None:
            print(f"cost model: {model.describe()} (median of 3 probes, their range in "
                  f"brackets)", flush=True)
        results = tune(factory, settings, steps=args.steps, budgets=budgets, warmup=args.warmup,
                       cost_model=model, overlap=args.overlap, telemetry_dir=args.telemetry_dir)
    return 0 if any(r.best for r in results) else 1
