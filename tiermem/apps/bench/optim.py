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
Clipping (``--max-grad-norm``, default ``off,1e6,1e-3``: what users run, Note [bench clip
rows]): each threshold is a block of its own; the AdamW rows (``gpu``, ``naive``) clip with
``torch.nn.utils.clip_grad_norm_``, every HybridAdam setup runs with ``max_grad_norm`` twice,
``wait`` (``rollback_bytes=0``: the CPU step waits for the norm) and ``spec`` (``--rollback-bytes``:
Note [speculative step]), ``spec/rb`` its speculated / rolled-back chunks over the timed steps.
Times are medians of the timed steps; ``x`` is relative to ``gpu`` at the same tokens/step and
clipping, ``vs off`` to the same setup without clipping.
``--world N`` (N > 1) runs the multi-process version instead: FSDP2 + fused AdamW against
FSDP2 + HybridAdam and data-parallel HybridAdam, see ``tiermem/apps/bench/optim_dist.py``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time

import torch

from tiermem import flags
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.names import parse_bytes
from tiermem.apps.bench.common import bench_device, learnable_batches, parse_clips
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


def _make_opt(name: str, model: torch.nn.Module, nvme_dir: str, accum: int, cpu_threads,
              clip: float | None = None, rollback_bytes: int = 0):
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
                      gpu_step_fraction=s["gpu"], max_grad_norm=clip,
                      rollback_bytes=rollback_bytes, **extra)


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


def _run_setup(name, cfg, batch, accum, n_steps, nvme_dir, cpu_threads, device, dtype,
               clip: float | None = None, rollback_bytes: int = 0) -> dict:
    """Train one setup ``n_steps`` + 1 steps (the first warms up), clipping the gradients'
    global norm to ``clip`` (AdamW: ``clip_grad_norm_`` in the timed step; HybridAdam:
    ``max_grad_norm`` with ``rollback_bytes``); times, losses and speculation counts."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).to(dtype=dtype)
    opt = _make_opt("gpu" if name == _AGAIN else name, model, nvme_dir, accum, cpu_threads,
                    clip, rollback_bytes)
    hybrid = isinstance(opt, HybridAdam)
    batches = learnable_batches(cfg.vocab, batch, cfg.seq_len, (n_steps + 1) * accum + 1, device)
    cuda = device.type == "cuda"
    times, losses, adam_ms, stall_ms, worker_ms = [], [], [], [], []
    spec = [0, 0]  # speculated, rolled-back chunks over the timed steps
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
        if clip is not None and not hybrid:  # the baseline clips as users do, in the step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()  # benchmark timing only: the step must have finished
        if step:
            times.append(time.perf_counter() - t0)
            if hybrid:                    # the last completed step (with
                stats = opt.step_stats()  # param_sync="forward": the one before)
                adam_ms.append(1e3 * stats["cpu_adam_s"])
                stall_ms.append(1e3 * stats["stall_s"])
                worker_ms.append(1e3 * stats["worker_s"])
                spec[0] += stats.get("speculated_chunks", 0)
                spec[1] += stats.get("rolled_back_chunks", 0)
        losses.append(total)
    if hybrid:
        opt.synchronize()
    with torch.no_grad():  # the final weights, seen through one more batch
        losses.append(model(*batches[-1])[1])
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {"ms": 1e3 * statistics.median(times), "losses": [float(x) for x in losses],
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "adam_ms": med(adam_ms), "stall_ms": med(stall_ms), "worker_ms": med(worker_ms),
           "spec": tuple(spec) if hybrid and clip is not None else None}
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


def _variants(name: str, clip: float | None, rollback_bytes: int) -> list[int]:
    """The ``rollback_bytes`` a setup runs with under ``clip``: one run unless it is a
    clipping HybridAdam setup, which waits (0) and, given a budget, speculates."""
    if name in ("gpu", "naive", _AGAIN) or clip is None or rollback_bytes <= 0:
        return [0]
    return [0, rollback_bytes]


def _clip_label(name: str, clip_text: str | None, rollback_bytes: int) -> str:
    """The ``clip`` column: ``-`` (no clipping), the threshold as written, and for HybridAdam
    ``wait`` (no rollback budget) or ``spec`` (speculating)."""
    if clip_text is None:
        return "-"
    if name in ("gpu", "naive", _AGAIN):
        return clip_text
    return f"{clip_text} {'spec' if rollback_bytes else 'wait'}"


def run(cfg: GPTConfig, batch: int, accums: list[int], setups: list[str], steps: int,
        nvme_dir: str, cpu_threads: int | None = None, nvme_steps: int = 2, repeats: int = 1,
        log=print, clips: list[tuple[str, float | None]] | None = None,
        rollback_bytes: int = 0) -> list[dict]:
    """Time each setup ``repeats`` times under each of ``clips`` (``(label, max_grad_norm or
    None)``, default no clipping; a clipping HybridAdam setup runs waiting and, with
    ``rollback_bytes > 0``, speculating); return rows with ``ms`` (median of the runs'
    medians), ``spread`` (their min, max), ``x``, ``vs_off`` (``ms`` over the same setup's
    unclipped row, when there is one), ``peak_gib``, ``loss``, ``spec`` (speculated, rolled-back
    chunks) and ``parity`` (the setup's losses against the first ``gpu`` run's under the same
    clipping, within 4x the noise of that ``gpu`` run twice; bf16 moments are a documented
    trade, :mod:`tiermem.apps.bench.parity`).

    Note [bench clip rows]: a clipped row is checked against AdamW clipped by
    ``clip_grad_norm_`` at the same threshold, with that baseline's own noise, never against
    an unclipped run (clipping changes the training: an unclipped reference would call a
    correct clipped step wrong, or hide a wrong one behind a loose noise bound).

    Raises:
        ValueError: an unknown setup name.
    """
    device = bench_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clips = clips or [("off", None)]
    rows = []
    for accum in accums:
        unclipped: dict[str, float] = {}
        for clip_text, clip in clips:
            base_ms, base, noise = None, None, 0.0
            for name in setups[:1] + [_AGAIN] + setups[1:]:
                for rb in _variants(name, clip, rollback_bytes):
                    rows.append(_one_row(name, cfg, batch, accum, steps, nvme_steps, nvme_dir,
                                         cpu_threads, device, dtype, clip, rb, repeats,
                                         base_ms, base, noise))
                    row = rows[-1]
                    if name == "gpu":
                        base_ms, base = row["ms"], row.pop("_losses")
                    elif name == _AGAIN:
                        noise = row.pop("_noise")
                    row.pop("_losses", None)
                    row["clip"] = _clip_label(name, clip_text if clip is not None else None, rb)
                    if clip is None:
                        unclipped[name] = row["ms"]
                    row["vs_off"] = row["ms"] / unclipped[name] if name in unclipped else None
                    log(f"  {row['setup']} clip {row['clip']} at {row['tokens']} tokens/step: "
                        f"{row['ms']:.1f} ms/step, {row['parity']}")
    return rows


def _one_row(name, cfg, batch, accum, steps, nvme_steps, nvme_dir, cpu_threads, device, dtype,
             clip, rollback_bytes, repeats, base_ms, base, noise) -> dict:
    """One table row: ``repeats`` runs of a setup and their parity against ``base`` (the
    baseline runs' losses under the same clipping; None: this is the baseline)."""
    n_steps = nvme_steps if ":nvme" in name else steps
    runs = [_run_setup(name, cfg, batch, accum, n_steps, nvme_dir, cpu_threads, device, dtype,
                       clip, rollback_bytes) for _ in range(repeats)]
    medians = [r["ms"] for r in runs]
    ms = statistics.median(medians)
    trade = "bf16 moments" if name not in ("gpu", "naive", _AGAIN) and \
        parse_setup(name)["bf16"] else None
    extra = {}
    if name == "gpu":
        base_ms, parity = ms, "baseline"
        extra["_losses"] = [r["losses"] for r in runs]
    else:
        if name == _AGAIN:
            noise = max(noise_of(base[0], r["losses"]) for r in runs)
            noise = max([noise] + [noise_of(base[0], b) for b in base[1:]])
            extra["_noise"] = noise
        verdicts = [verdict(*_aligned(r["losses"], base[0]), noise, trade) for r in runs]
        parity = worst_verdict(verdicts)
    last = runs[-1]
    label = _label("gpu", device) + " again (noise)" if name == _AGAIN else _label(name, device)
    return {"setup": label, "tokens": batch * cfg.seq_len * accum, "ms": ms,
            "spread": (min(medians), max(medians)),
            "x": ms / base_ms if base_ms else float("nan"),
            "peak_gib": last["peak_gib"], "loss": last["losses"][-1],
            "adam_ms": last["adam_ms"], "stall_ms": last["stall_ms"],
            "worker_ms": last["worker_ms"], "spec": last["spec"], "parity": parity, **extra}


def format_table(rows: list[dict], header: bool = True) -> str:
    """Render rows as a fixed-width table (times in ms, peak in GiB; ``-`` where not measured;
    ``spec/rb``: speculated / rolled-back chunks of the last run's timed steps)."""
    def num(value, fmt):
        return "-" if value is None or value != value else format(value, fmt)

    lines = [f"{'setup':<37}{'clip':>11}{'tokens/step':>12}{'ms/step':>9}{'spread':>12}"
             f"{'x':>7}{'vs off':>8}{'peak GiB':>9}{'loss':>8}{'cpu adam ms':>12}"
             f"{'worker ms':>10}{'stall ms':>9}{'spec/rb':>9}  parity"] if header else []
    for r in rows:
        spread = f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f}" if "spread" in r else "-"
        spec = "-" if r.get("spec") is None else f"{r['spec'][0]}/{r['spec'][1]}"
        lines.append(f"{r['setup']:<37}{r.get('clip', '-'):>11}{r['tokens']:>12}"
                     f"{r['ms']:>9.1f}{spread:>12}{num(r['x'], '.2f') + 'x':>7}"
                     f"{num(r.get('vs_off'), '.2f') + 'x':>8}{num(r['peak_gib'], '.1f'):>9}"
                     f"{r['loss']:>8.4f}{num(r.get('adam_ms'), '.1f'):>12}"
                     f"{num(r.get('worker_ms'), '.1f'):>10}{num(r.get('stall_ms'), '.1f'):>9}"
                     f"{spec:>9}  {r.get('parity', '')}")
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
    add = functools.partial(flags.add, parser, "bench optim")  # the fields: tiermem/flags.py
    add("--grad-accumulation-steps", dest="accum", default="1,4",
        help="micro-batches per step, comma-separated")
    parser.add_argument("--setups", default=None,
                        help="gpu, naive, or F[:cpu|nvme][+fwd][+bf16][+chunk=N] (fraction F, "
                             "state tier, param_sync='forward', bf16 moments, chunk_numel; "
                             "default gpu,naive,0.25,0.5,1.0,1.0:nvme); with --world > 1: gpu, F[:T], "
                             "fsdp:F[:T] or dp:F[:T] (default gpu,0.5,1.0)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setup")
    parser.add_argument("--nvme-steps", type=int, default=2, help="timed steps of NVMe setups")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every setup; ms/step is the median of the runs' medians")
    add("--nvme-dir", default=None, help="spill directory (default: a temp dir)")
    add("--cpu-threads", type=int, default=None, help="threads of the CPU Adam")
    add("--max-grad-norm", dest="clip", default=None,
        help="max_grad_norm thresholds, comma-separated, 'off' for none (default "
             "off,1e6,1e-3: 1e6 never clips, 1e-3 always does; one process only)")
    add("--rollback-bytes", default="4GiB",
        help="HybridAdam rollback_bytes of the speculating clip rows (bytes or "
             "'4GiB'; 0: only the rows that wait for the norm)")
    parser.add_argument("--world", type=int, default=1,
                        help="processes (one GPU each on CUDA, gloo on the CPU otherwise); > 1 "
                             "benchmarks FSDP2 / data parallel (tiermem/apps/bench/optim_dist.py)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before the --world ranks are stopped (default 1800)")
    args = parser.parse_args(argv)
    if args.world != 1:
        if args.clip not in (None, "off"):
            print("error: --max-grad-norm: not with --world > 1 (the distributed table does not "
                  "clip); leave it out or pass --max-grad-norm off", file=sys.stderr)
            return 2
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
        clips = parse_clips(args.clip or "off,1e6,1e-3")
        rollback_bytes = parse_bytes(args.rollback_bytes, "--rollback-bytes")
    except (ValueError, TypeError) as exc:
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
                   log=lambda line: print(line, file=sys.stderr, flush=True), clips=clips,
                   rollback_bytes=rollback_bytes)
    print(format_table(rows))
    return report_wrong([r["setup"] + ("" if r["clip"] == "-" else f" clip {r['clip']}")
                         for r in rows if r["parity"].startswith("WRONG")],
                        sys.stderr, "the baseline (clipped the same way)")


if __name__ == "__main__":
    raise SystemExit(main())
