"""``tiermem bench optim``: training-step time and peak GPU memory of optimizer placements.

Side by side in one run, on the reference GPT (bf16 params; docs/benchmarks.md), for each tokens-per-step
setting (micro-batches accumulated per optimizer step):
- ``gpu``: fp32 masters and torch fused AdamW on the GPU (what users do without offload);
- ``naive``: grads D2H after backward, torch fused AdamW on pinned fp32 masters, cast, H2D
  (a straightforward full offload);
- ``hybrid f=F``: HybridAdam with ``offload_fraction=F`` and state in pinned RAM;
- ``hybrid f=1 nvme``: HybridAdam with all state streamed through NVMe;
- a ``+fwd`` suffix (``0.5+fwd``): the same with ``param_sync="forward"`` (the next forward
  waits per module for the updated params instead of ``step()`` waiting for all of them).
``cpu adam ms`` is the CPU kernel time of a step (summed over chunks), ``worker ms`` the CPU
worker's busy time (kernel + copy waits + per-chunk bookkeeping), ``stall ms`` the time the
step waited for the CPU side after backward. Modifiers: ``+bf16`` (bf16 moments, a precision
trade), ``+chunk=16M`` (``chunk_numel``), ``+gpu=0.5`` (``gpu_step_fraction``: half the
offloaded chunks stepped by the GPU streaming their state, Note [gpu lane]).
Times are medians of the timed steps; ``x`` is relative to ``gpu`` at the same tokens/step.
``--world N`` (N > 1) runs the multi-process version instead: FSDP2 + fused AdamW against
FSDP2 + HybridAdam and data-parallel HybridAdam, see ``tiermem/apps/bench/optim_dist.py``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time

import torch

from tiermem.models.gpt import GPT, GPTConfig
from tiermem.apps.bench.common import bench_device, learnable_batches
from tiermem.apps.bench.optim_base import HP, _GpuMasters
from tiermem.apps.bench.parity import noise_of, report_wrong, verdict, worst_verdict
from tiermem.optim import HybridAdam


class _NaiveOffload:
    """Grads D2H after backward, torch fused AdamW on pinned fp32 masters, cast, H2D."""

    def __init__(self, params):
        pin = torch.cuda.is_available()
        self.params = list(params)
        self.masters = [p.detach().float().cpu().pin_memory() if pin else p.detach().float().cpu()
                        for p in self.params]
        self.grads = [torch.empty_like(m) for m in self.masters]
        self.out = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in self.params]
        for m, g in zip(self.masters, self.grads):
            m.grad = g
        self.opt = torch.optim.AdamW(self.masters, **HP, fused=True if pin else None)

    def step(self):
        for g, p in zip(self.grads, self.params):
            g.copy_(p.grad, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the CPU step needs the gradients (this is the naive way)
        self.opt.step()
        for o, m, p in zip(self.out, self.masters, self.params):
            o.copy_(m)
            p.data.copy_(o, non_blocking=True)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def close(self):
        pass


def parse_setup(name: str) -> dict:
    """Parse a HybridAdam setup name ``F[:tier][+fwd][+bf16][+chunk=N][+gpu=G]``.

    ``F``: offload fraction; ``tier``: ``cpu`` (default) or ``nvme``; ``+fwd``:
    ``param_sync="forward"``; ``+bf16``: bf16 moments; ``+chunk=N``: ``chunk_numel`` (elements;
    a ``K``/``M`` suffix multiplies by 2**10 / 2**20); ``+gpu=G``: ``gpu_step_fraction``.

    Raises:
        ValueError: a malformed name, naming it and the grammar.
    """
    head, *mods = name.split("+")
    fraction, _, tier = head.partition(":")
    out = {"fraction": None, "tier": tier or "cpu", "fwd": False, "bf16": False, "chunk": None,
           "gpu": 0.0}
    try:
        out["fraction"] = float(fraction)
        for mod in mods:
            if mod in ("fwd", "bf16"):
                out[mod] = True
            elif mod.startswith("chunk="):
                num = mod.removeprefix("chunk=")
                scale = {"K": 1 << 10, "M": 1 << 20}.get(num[-1:], 1)
                out["chunk"] = int(num[:-1] if scale > 1 else num) * scale
            elif mod.startswith("gpu="):
                out["gpu"] = float(mod.removeprefix("gpu="))
            else:
                raise ValueError(mod)
        ok = (0.0 <= out["fraction"] <= 1.0 and out["tier"] in ("cpu", "nvme")
              and 0.0 <= out["gpu"] <= 1.0)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--setups: {name!r} is not gpu, naive or F[:tier][+fwd][+bf16]"
                         f"[+chunk=N][+gpu=G] with F and G in [0, 1], tier cpu or nvme, N "
                         f"elements (e.g. 16M)")
    return out


def _make_opt(name: str, model: torch.nn.Module, nvme_dir: str, accum: int, cpu_threads):
    if name == "gpu":
        return _GpuMasters(model.parameters())
    if name == "naive":
        return _NaiveOffload(model.parameters())
    s = parse_setup(name)
    extra = {"chunk_numel": s["chunk"]} if s["chunk"] else {}
    return HybridAdam(model.parameters(), **HP, offload_fraction=s["fraction"],
                      state_tier=s["tier"], nvme_dir=nvme_dir, grad_accumulation_steps=accum,
                      cpu_threads=cpu_threads, param_sync="forward" if s["fwd"] else "step",
                      moments_dtype=torch.bfloat16 if s["bf16"] else torch.float32,
                      gpu_step_fraction=s["gpu"], **extra)


def _label(name: str, device: torch.device) -> str:
    if name in ("gpu", "naive"):
        base = "GPU-only fused AdamW" if device.type == "cuda" else "CPU-only AdamW"
        return {"gpu": base, "naive": "naive full offload"}[name]
    s = parse_setup(name)
    chunk = s["chunk"]
    size = "" if chunk is None else (f" c{chunk >> 20}M" if chunk % (1 << 20) == 0 else f" c{chunk}")
    lane = f" gpu={s['gpu']:g}" if s["gpu"] else ""
    return (f"HybridAdam f={s['fraction']:g} {s['tier']}{' fwd' if s['fwd'] else ''}"
            f"{' bf16m' if s['bf16'] else ''}{size}{lane}")


_AGAIN = "gpu again"  # the baseline run twice: its run-to-run noise


def _run_setup(name, cfg, batch, accum, n_steps, nvme_dir, cpu_threads, device, dtype) -> dict:
    """Train one setup ``n_steps`` + 1 steps (the first warms up); times and losses."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).to(dtype=dtype)
    opt = _make_opt("gpu" if name == _AGAIN else name, model, nvme_dir, accum, cpu_threads)
    batches = learnable_batches(cfg.vocab, batch, cfg.seq_len, (n_steps + 1) * accum + 1, device)
    cuda = device.type == "cuda"
    times, losses, adam_ms, stall_ms, worker_ms = [], [], [], [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for step in range(n_steps + 1):
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(accum):
            _, loss = model(*batches[step * accum + micro])
            (loss / accum).backward()
            total = total + loss.detach() / accum
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()  # benchmark timing only: the step must have finished
        if step:
            times.append(time.perf_counter() - t0)
            if isinstance(opt, HybridAdam):  # the last completed step (with
                stats = opt.step_stats()     # param_sync="forward": the one before)
                adam_ms.append(1e3 * stats["cpu_adam_s"])
                stall_ms.append(1e3 * stats["stall_s"])
                worker_ms.append(1e3 * stats["worker_s"])
        losses.append(total)
    if isinstance(opt, HybridAdam):
        opt.synchronize()
    with torch.no_grad():  # the final weights, seen through one more batch
        losses.append(model(*batches[-1])[1])
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {"ms": 1e3 * statistics.median(times), "losses": [float(x) for x in losses],
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "adam_ms": med(adam_ms), "stall_ms": med(stall_ms), "worker_ms": med(worker_ms)}
    opt.close()
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _aligned(losses: list[float], base: list[float]) -> tuple[list[float], list[float]]:
    """Comparable losses: all of them, or for a setup with fewer steps (NVMe) its steps only
    (its after-the-last-step loss comes after fewer updates than the baseline's)."""
    if len(losses) == len(base):
        return losses, base
    k = min(len(losses), len(base)) - 1
    return losses[:k], base[:k]


def run(cfg: GPTConfig, batch: int, accums: list[int], setups: list[str], steps: int,
        nvme_dir: str, cpu_threads: int | None = None, nvme_steps: int = 2, repeats: int = 1,
        log=print) -> list[dict]:
    """Time each setup ``repeats`` times; return rows with ``ms`` (median of the runs'
    medians), ``spread`` (their min, max), ``x``, ``peak_gib``, ``loss`` and ``parity`` (the
    setup's losses against the first ``gpu`` run's, within 4x the noise of ``gpu`` run twice;
    bf16 moments are a documented trade, :mod:`tiermem.apps.bench.parity`).

    Raises:
        ValueError: an unknown setup name.
    """
    device = bench_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for accum in accums:
        base_ms, base, noise = None, None, 0.0
        for name in setups[:1] + [_AGAIN] + setups[1:]:
            n_steps = nvme_steps if ":nvme" in name else steps
            runs = [_run_setup(name, cfg, batch, accum, n_steps, nvme_dir, cpu_threads, device,
                               dtype) for _ in range(repeats)]
            medians = [r["ms"] for r in runs]
            ms = statistics.median(medians)
            trade = "bf16 moments" if name not in ("gpu", "naive", _AGAIN) and \
                parse_setup(name)["bf16"] else None
            if name == "gpu":
                base_ms, base, parity = ms, [r["losses"] for r in runs], "baseline"
            else:
                if name == _AGAIN:
                    noise = max(noise_of(base[0], r["losses"]) for r in runs)
                    noise = max([noise] + [noise_of(base[0], b) for b in base[1:]])
                verdicts = [verdict(*_aligned(r["losses"], base[0]), noise, trade) for r in runs]
                parity = worst_verdict(verdicts)
            last = runs[-1]
            label = _label("gpu", device) + " again (noise)" if name == _AGAIN \
                else _label(name, device)
            rows.append({"setup": label, "tokens": batch * cfg.seq_len * accum,
                         "ms": ms, "spread": (min(medians), max(medians)),
                         "x": ms / base_ms if base_ms else float("nan"),
                         "peak_gib": last["peak_gib"], "loss": last["losses"][-1],
                         "adam_ms": last["adam_ms"], "stall_ms": last["stall_ms"],
                         "worker_ms": last["worker_ms"], "parity": parity})
            log(f"  {label} at {rows[-1]['tokens']} tokens/step: {ms:.1f} ms/step, {parity}")
    return rows


def format_table(rows: list[dict], header: bool = True) -> str:
    """Render rows as a fixed-width table (times in ms, peak in GiB; ``-`` where not measured)."""
    def num(value, fmt):
        return "-" if value is None or value != value else format(value, fmt)

    lines = [f"{'setup':<37}{'tokens/step':>12}{'ms/step':>10}{'spread':>15}{'x':>8}"
             f"{'peak GiB':>10}{'loss':>9}{'cpu adam ms':>12}{'worker ms':>10}{'stall ms':>9}"
             f"  parity"] if header else []
    for r in rows:
        spread = f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f}" if "spread" in r else "-"
        lines.append(f"{r['setup']:<37}{r['tokens']:>12}{r['ms']:>10.1f}{spread:>15}"
                     f"{num(r['x'], '.2f'):>7}x{num(r['peak_gib'], '.1f'):>10}"
                     f"{r['loss']:>9.4f}{num(r.get('adam_ms'), '.1f'):>12}"
                     f"{num(r.get('worker_ms'), '.1f'):>10}{num(r.get('stall_ms'), '.1f'):>9}"
                     f"  {r.get('parity', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tiermem bench optim`` (see ``--help``); returns the exit code (0 ok, 1 a setup's
    losses differ from the baseline's, 2 bad input)."""
    big = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="tiermem bench optim", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24 if big else 2)
    parser.add_argument("--d-model", type=int, default=2048 if big else 64)
    parser.add_argument("--heads", type=int, default=16 if big else 4)
    parser.add_argument("--seq", type=int, default=2048 if big else 32)
    parser.add_argument("--vocab", type=int, default=32000 if big else 128)
    parser.add_argument("--batch", type=int, default=8 if big else 2, help="micro-batch size")
    parser.add_argument("--accum", default="1,4", help="micro-batches per step, comma-separated")
    parser.add_argument("--setups", default=None,
                        help="gpu, naive, or F[:cpu|nvme][+fwd][+bf16][+chunk=N] (fraction F, "
                             "state tier, param_sync='forward', bf16 moments, chunk_numel; "
                             "default gpu,naive,0.25,0.5,1.0,1.0:nvme); with --world > 1: gpu, F[:T], "
                             "fsdp:F[:T] or dp:F[:T] (default gpu,0.5,1.0)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setup")
    parser.add_argument("--nvme-steps", type=int, default=2, help="timed steps of NVMe setups")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every setup; ms/step is the median of the runs' medians")
    parser.add_argument("--nvme-dir", default=None, help="spill directory (default: a temp dir)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="threads of the CPU Adam")
    parser.add_argument("--world", type=int, default=1,
                        help="processes (one GPU each on CUDA, gloo on the CPU otherwise); > 1 "
                             "benchmarks FSDP2 / data parallel (tiermem/apps/bench/optim_dist.py)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before the --world ranks are stopped (default 1800)")
    args = parser.parse_args(argv)
    if args.world != 1:
        from tiermem.apps.bench import optim_dist
        return optim_dist.main_dist(args)
    args.setups = args.setups or "gpu,naive,0.25,0.5,1.0,1.0:nvme"
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    try:
        for s in setups:
            if s not in ("gpu", "naive"):
                parse_setup(s)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "gpu" in setups:
        setups.remove("gpu")
    setups.insert(0, "gpu")
    accums = [int(a) for a in args.accum.split(",")]
    print(f"bench optim: GPT {cfg.num_params() / 1e9:.2f}B params, micro-batch {args.batch} x "
          f"{args.seq} tokens, on {torch.cuda.get_device_name() if big else 'CPU'}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        rows = run(cfg, args.batch, accums, setups, args.steps, tmp, args.cpu_threads,
                   args.nvme_steps, args.repeats,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(rows))
    return report_wrong([r["setup"] for r in rows if r["parity"].startswith("WRONG")],
                        sys.stderr, "the baseline")


if __name__ == "__main__":
    raise SystemExit(main())
