"""``tiermem bench optim``: training-step time and peak GPU memory of optimizer placements.

Side by side in one run, on the reference GPT (bf16 params; DESIGN.md), for each tokens-per-step
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
FSDP2 + HybridAdam and data-parallel HybridAdam, see ``tiermem/bench/optim_dist.py``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch

from tiermem.bench._gpt import GPT, GPTConfig
from tiermem.optim import HybridAdam

HP = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class _GpuMasters:
    """fp32 masters + torch fused AdamW on the GPU, params = masters cast (the baseline)."""

    def __init__(self, params):
        self.params = list(params)
        self.masters = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **HP, fused=True)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float()
        self.opt.step()
        for m, p in zip(self.masters, self.params):
            p.data.copy_(m)
            m.grad = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def close(self):
        pass


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
        self.opt = torch.optim.AdamW(self.masters, **HP, fused=True)

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


def _label(name: str) -> str:
    if name in ("gpu", "naive"):
        return {"gpu": "GPU-only fused AdamW", "naive": "naive full offload"}[name]
    s = parse_setup(name)
    chunk = s["chunk"]
    size = "" if chunk is None else (f" c{chunk >> 20}M" if chunk % (1 << 20) == 0 else f" c{chunk}")
    lane = f" gpu={s['gpu']:g}" if s["gpu"] else ""
    return (f"HybridAdam f={s['fraction']:g} {s['tier']}{' fwd' if s['fwd'] else ''}"
            f"{' bf16m' if s['bf16'] else ''}{size}{lane}")


def run(cfg: GPTConfig, batch: int, accums: list[int], setups: list[str], steps: int,
        nvme_dir: str, cpu_threads: int | None = None, nvme_steps: int = 2) -> list[dict]:
    """Time each setup; return rows with ``ms``, ``x`` and ``peak_gib``.

    Raises:
        ValueError: an unknown setup name.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for accum in accums:
        base_ms = None
        for name in setups:
            torch.manual_seed(0)
            model = GPT(cfg).to(device=device, dtype=dtype)
            opt = _make_opt(name, model, nvme_dir, accum, cpu_threads)
            gen = torch.Generator(device="cpu").manual_seed(0)
            idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen).to(device)
            n_steps = nvme_steps if name.endswith("nvme") else steps
            times, losses, adam_ms, stall_ms, worker_ms = [], [], [], [], []
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for step in range(n_steps + 1):  # the first step warms up
                t0 = time.perf_counter()
                for _ in range(accum):
                    _, loss = model(idx, idx)
                    (loss / accum).backward()
                opt.step()
                opt.zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                if step:
                    times.append(time.perf_counter() - t0)
                    if isinstance(opt, HybridAdam):  # the last completed step (with
                        stats = opt.step_stats()     # param_sync="forward": the one before)
                        adam_ms.append(1e3 * stats["cpu_adam_s"])
                        stall_ms.append(1e3 * stats["stall_s"])
                        worker_ms.append(1e3 * stats["worker_s"])
                losses.append(loss.item())
            ms = 1e3 * statistics.median(times)
            if name == "gpu":
                base_ms = ms
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            rows.append({"setup": _label(name), "tokens": batch * cfg.seq_len * accum,
                         "ms": ms, "x": ms / base_ms if base_ms else float("nan"),
                         "peak_gib": peak, "loss": losses[-1],
                         "adam_ms": statistics.median(adam_ms) if adam_ms else float("nan"),
                         "stall_ms": statistics.median(stall_ms) if stall_ms else float("nan"),
                         "worker_ms": statistics.median(worker_ms) if worker_ms else float("nan")})
            print(format_table(rows[-1:], header=False), flush=True)
            opt.close()
            del model, opt
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], header: bool = True) -> str:
    """Render rows as a fixed-width table."""
    lines = [f"{'setup':<37}{'tokens/step':>12}{'ms/step':>10}{'x':>8}{'peak GiB':>10}"
             f"{'loss':>9}{'cpu adam ms':>12}{'worker ms':>10}{'stall ms':>9}"] if header else []
    for r in rows:
        lines.append(f"{r['setup']:<37}{r['tokens']:>12}{r['ms']:>10.1f}{r['x']:>7.2f}x"
                     f"{r['peak_gib']:>10.1f}{r['loss']:>9.4f}{r.get('adam_ms', float('nan')):>12.1f}"
                     f"{r.get('worker_ms', float('nan')):>10.1f}"
                     f"{r.get('stall_ms', float('nan')):>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tiermem bench optim`` (see ``--help``); returns the exit code."""
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
    parser.add_argument("--nvme-dir", default=None, help="spill directory (default: a temp dir)")
    parser.add_argument("--cpu-threads", type=int, default=None, help="threads of the CPU Adam")
    parser.add_argument("--world", type=int, default=1,
                        help="processes (one GPU each on CUDA, gloo on the CPU otherwise); > 1 "
                             "benchmarks FSDP2 / data parallel (tiermem/bench/optim_dist.py)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before the --world ranks are stopped (default 1800)")
    args = parser.parse_args(argv)
    if args.world != 1:
        from tiermem.bench import optim_dist
        return optim_dist.main_dist(args)
    args.setups = args.setups or "gpu,naive,0.25,0.5,1.0,1.0:nvme"
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    for s in setups:
        if s not in ("gpu", "naive"):
            parse_setup(s)
    if "gpu" in setups:
        setups.remove("gpu")
    setups.insert(0, "gpu")
    accums = [int(a) for a in args.accum.split(",")]
    print(f"bench optim: GPT {cfg.num_params() / 1e9:.2f}B params, micro-batch {args.batch} x "
          f"{args.seq} tokens, on {torch.cuda.get_device_name() if big else 'CPU'}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        rows = run(cfg, args.batch, accums, setups, args.steps, tmp, args.cpu_threads,
                   args.nvme_steps)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
