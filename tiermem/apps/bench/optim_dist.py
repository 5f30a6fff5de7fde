"""``tiermem bench optim --world N``: optimizer placements on N ranks (torch.distributed).

The command spawns ``N`` processes itself (127.0.0.1, a free TCP port): NCCL with one GPU per
rank when CUDA has at least ``N`` GPUs, else gloo on the CPU. Every rank builds the same
reference GPT (``tiermem/models/gpt.py``, same seed) and trains on its own micro-batches (a
fixed seed per rank). Side by side in one run, for each ``--grad-accumulation-steps`` setting
(micro-batches per optimizer step; the FSDP2 rows reduce-scatter after every micro-batch,
FSDP2's default, which keeps gradients sharded; the data-parallel rows reduce only after the
last one):

- ``fsdp2 fused AdamW (GPU)``: ``fully_shard`` on every block and the root with fp32 params,
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on CUDA (plain fp32 on
  the CPU), ``torch.optim.AdamW(fused=True)``: what users do today (the baseline);
- ``fsdp2 + HybridAdam f=F T``: the same FSDP2 model with bf16 params (fp32 on the CPU), no
  mixed-precision policy, ``HybridAdam(offload_fraction=F, state_tier=T)`` stepping each
  rank's local shards;
- ``dp HybridAdam f=F T``: a replicated bf16 model (no DDP wrapper) and
  ``HybridAdam(data_parallel=True, offload_fraction=F, state_tier=T)`` (ZeRO-1/2).

Hyper-parameters are ``tiermem.apps.bench.optim_base.HP``. Columns (rank 0 prints them after
gathering
every rank's numbers):

- ``tokens/step``: tokens per optimizer step over all ranks (``world * batch * seq * accum``);
- ``ms/step``: milliseconds per optimizer step (all micro-batches and the step), the median of
  the timed steps (the first step warms up and is not timed), the maximum over ranks;
- ``x``: ``ms/step`` over the baseline's at the same ``tokens/step``;
- ``peak GiB``: ``torch.cuda.max_memory_allocated`` in GiB (2**30 bytes), reset after the model
  and the optimizer are built, the maximum over ranks (``-`` on the CPU);
- ``state GPU`` / ``state off``: GiB of optimizer state per rank (the maximum over ranks) on
  the GPU and off it. Optimizer state = fp32 masters + ``exp_avg`` + ``exp_avg_sq``. For the
  baseline the fp32 sharded params *are* the masters and are counted (12 bytes per local
  element, all on the GPU); for HybridAdam ``state GPU`` is ``memory_bytes()["gpu"]`` and
  ``state off`` its offloaded elements times 12 bytes (the fp32 master and moments in pinned RAM
  or on NVMe; its pinned gradient and param-staging buffers, in the model dtype, are not state:
  the rows carry them, with the state, as ``host_bytes`` = ``memory_bytes()["cpu"] + ["nvme"]``);
- ``unsharded``: GiB of the same state in one process (12 bytes per model parameter);
- ``share``: elements whose state this rank holds / model parameters (``1/world`` when the
  state is sharded: per-GPU optimizer memory = ``share`` x ``unsharded``);
- ``loss``: the last step's loss, averaged over ranks (the same data and the same Adam math in
  every setup, so it agrees across rows up to bf16 rounding).

Errors on a rank stop every rank and name the rank; the command then exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.multiprocessing as mp

from tiermem.names import gib
from tiermem.models.gpt import GPT, GPTConfig
from tiermem.apps.bench.optim_base import HP
from tiermem.optim import HybridAdam
from tiermem.optim.distributed import local_of

STATE_BYTES_PER_ELEMENT = 12
"""fp32 master + fp32 ``exp_avg`` + fp32 ``exp_avg_sq``."""

DEFAULT_SETUPS = "gpu,0.5,1.0"
"""``--setups`` with ``--world`` > 1 when none is given."""

DEFAULT_TIMEOUT_S = 1800.0
"""Seconds the whole multi-rank run may take before every rank is stopped."""

BASELINE = "fsdp2 fused AdamW (GPU)"


class RankFailed(RuntimeError):
    """A rank raised, died or hung; ``rows`` holds the rows finished before."""

    def __init__(self, message: str, rows: list[dict]) -> None:
        super().__init__(message)
        self.rows = rows


def check_world(world: int) -> str:
    """The backend for ``--world`` ranks: ``"nccl"`` (one CUDA GPU per rank) or ``"gloo"``
    (CPU, when CUDA is not available).

    Raises:
        ValueError: ``world`` < 1, or more ranks than visible CUDA GPUs, naming the fix.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--world={world!r} must be >= 1 (processes, one GPU each on CUDA; 1 "
                         f"runs the single-process benchmark)")
    if not torch.cuda.is_available():
        return "gloo"
    gpus = torch.cuda.device_count()
    if world > gpus:
        raise ValueError(f"--world={world} but {gpus} CUDA GPU(s) are visible; use --world "
                         f"{gpus} or less (one GPU per rank) or make more GPUs visible "
                         f"(CUDA_VISIBLE_DEVICES)")
    return "nccl"


@dataclass(frozen=True)
class Setup:
    """One row: ``kind`` is ``"adamw"`` (the FSDP2 baseline), ``"fsdp"`` or ``"dp"``
    (HybridAdam with ``offload_fraction=fraction`` and ``state_tier=tier``)."""

    kind: str
    fraction: float = 0.0
    tier: str = "cpu"

    @property
    def label(self) -> str:
        """The row's name in the table."""
        if self.kind == "adamw":
            return BASELINE
        prefix = "fsdp2 + HybridAdam" if self.kind == "fsdp" else "dp HybridAdam"
        return f"{prefix} f={self.fraction:g} {self.tier}"


def parse_setups(text: str | None) -> list[Setup]:
    """Parse ``--setups`` for ``--world`` > 1; the baseline always comes first.

    Items, comma-separated: ``gpu`` (the baseline; added when missing), ``F`` or ``F:T`` (both
    ``fsdp2 + HybridAdam`` and ``dp HybridAdam`` with ``offload_fraction=F`` in [0, 1] and
    ``state_tier=T``, ``cpu`` or ``nvme``), ``fsdp:F[:T]`` or ``dp:F[:T]`` (one of them).
    FSDP2 rows come before data-parallel rows.

    Raises:
        ValueError: an item of another form (``naive`` is single-process only), naming it.
    """
    fsdp, dp = [], []
    for item in (text or DEFAULT_SETUPS).split(","):
        item = item.strip()
        if not item or item == "gpu":
            continue
        parts = item.split(":")
        kinds = ("fsdp", "dp")
        if parts[0] in kinds:
            kinds, parts = (parts[0],), parts[1:]
        try:
            fraction = float(parts[0])
            tier = parts[1] if len(parts) > 1 else "cpu"
            ok = 0.0 <= fraction <= 1.0 and tier in ("cpu", "nvme") and len(parts) <= 2
        except (ValueError, IndexError):
            ok = False
        if not ok:
            raise ValueError(f"--setups: {item!r} is not gpu, F, F:T, fsdp:F[:T] or dp:F[:T] "
                             f"with F in [0, 1] and T cpu or nvme (with --world > 1; 'naive' "
                             f"runs only with --world 1)")
        for kind in kinds:
            (fsdp if kind == "fsdp" else dp).append(Setup(kind, fraction, tier))
    return [Setup("adamw")] + list(dict.fromkeys(fsdp)) + list(dict.fromkeys(dp))


@dataclass
class Spec:
    """What every rank runs (picklable: it crosses the spawn)."""

    cfg: dict
    batch: int
    accums: list[int]
    setups: list[Setup]
    steps: int
    nvme_steps: int
    cpu_threads: int | None
    workdir: str
    timeout_s: float


# ---------------------------------------------------------------------------- on every rank


def _build(setup: Setup, cfg: GPTConfig, device: torch.device, accum: int, spec: Spec):
    """The model and optimizer of one setup on this rank; ``(model, opt)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    if setup.kind == "adamw":
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                     if cuda else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        return model, torch.optim.AdamW(model.parameters(), **HP, fused=True)
    if cuda:
        model = model.to(torch.bfloat16)
    if setup.kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = HybridAdam(model.parameters(), **HP, offload_fraction=setup.fraction,
                     state_tier=setup.tier, nvme_dir=os.path.join(spec.workdir, "spill"),
                     grad_accumulation_steps=accum, cpu_threads=spec.cpu_threads,
                     data_parallel=True if setup.kind == "dp" else None)
    return model, opt


def _state(model: torch.nn.Module, opt) -> dict:
    """This rank's optimizer state: bytes on and off the GPU, elements held, host bytes."""
    if isinstance(opt, HybridAdam):
        numel, mem = opt.state_numel(), opt.memory_bytes()
        return {"gpu_bytes": mem["gpu"],
                "off_bytes": numel["offloaded"] * STATE_BYTES_PER_ELEMENT,
                "held": numel["gpu"] + numel["offloaded"],
                "host_bytes": mem["cpu"] + mem["nvme"]}
    gpu = held = 0
    for p in model.parameters():
        local = local_of(p)
        held += local.numel()
        gpu += local.numel() * local.element_size()  # the fp32 params are the masters
        st = opt.state.get(p, {})
        gpu += sum(local_of(st[k]).nbytes for k in ("exp_avg", "exp_avg_sq") if k in st)
    return {"gpu_bytes": gpu, "off_bytes": 0, "held": held, "host_bytes": 0}


def _time_setup(setup: Setup, accum: int, spec: Spec, device: torch.device, rank: int) -> dict:
    """Build, train ``steps + 1`` steps (the first untimed), measure; this rank's numbers."""
    import torch.distributed as dist

    cfg = GPTConfig(**spec.cfg)
    cuda = device.type == "cuda"
    model, opt = _build(setup, cfg, device, accum, spec)
    gen = torch.Generator(device="cpu").manual_seed(1 + rank)  # each rank its own batch
    idx = torch.randint(0, cfg.vocab, (spec.batch, cfg.seq_len), generator=gen).to(device)
    n_steps = spec.nvme_steps if setup.tier == "nvme" and setup.kind != "adamw" else spec.steps
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    times, losses = [], []
    for step in range(n_steps + 1):
        t0 = time.perf_counter()
        for _ in range(accum):
            _, loss = model(idx, idx)
            (loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
    mine = {"ms": 1e3 * statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "total": sum(p.numel() for p in model.parameters()),  # global numel of DTensors
            **_state(model, opt)}
    mean_loss = torch.stack(losses)
    dist.all_reduce(mean_loss)
    mine["losses"] = (mean_loss / dist.get_world_size()).tolist()
    if isinstance(opt, HybridAdam):
        opt.close()
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return mine


def _combine(setup: Setup, accum: int, spec: Spec, world: int, ranks: list[dict]) -> dict:
    """One table row from every rank's numbers (maxima over ranks)."""
    total = ranks[0]["total"]
    peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
    return {"setup": setup.label, "tokens": world * spec.batch * spec.cfg["seq_len"] * accum,
            "accum": accum, "ms": max(r["ms"] for r in ranks), "x": float("nan"),
            "peak_gib": max(peaks) if peaks else None,
            "gpu_bytes": max(r["gpu_bytes"] for r in ranks),
            "off_bytes": max(r["off_bytes"] for r in ranks),
            "host_bytes": max(r["host_bytes"] for r in ranks),
            "unsharded_bytes": total * STATE_BYTES_PER_ELEMENT,
            "share": max(r["held"] for r in ranks) / total,
            "loss": ranks[0]["losses"][-1], "losses": ranks[0]["losses"],
            "ms_per_rank": [r["ms"] for r in ranks]}


def _rank_main(rank: int, world: int, port: int, backend: str, spec: Spec) -> None:
    """Entry point of one spawned rank: time every setup, rank 0 writes ``rows.json``.

    Raises:
        RuntimeError: any failure, prefixed with the rank, the setup and the accumulation.
    """
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // world))  # the ranks share the host's cores
    where = "starting"
    try:
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            kw["device_id"] = device
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec.timeout_s), **kw)
        rows = []
        for accum in spec.accums:
            for setup in spec.setups:
                where = f"setup {setup.label!r}, --grad-accumulation-steps {accum}"
                mine = _time_setup(setup, accum, spec, device, rank)
                ranks = [None] * world
                dist.all_gather_object(ranks, mine)
                if rank:
                    continue
                row = _combine(setup, accum, spec, world, ranks)
                base = [r for r in rows if r["accum"] == accum and r["setup"] == BASELINE]
                row["x"] = row["ms"] / base[0]["ms"] if base else 1.0
                rows.append(row)
                print(format_table(rows[-1:], header=False), flush=True)
                with open(os.path.join(spec.workdir, "rows.json.tmp"), "w") as f:
                    json.dump(rows, f)
                os.replace(os.path.join(spec.workdir, "rows.json.tmp"),
                           os.path.join(spec.workdir, "rows.json"))
        where = "shutting down"
        gc.collect()
        dist.barrier()  # no rank tears down while another is still communicating
        open(os.path.join(spec.workdir, f"done.rank{rank}"), "w").close()
        dist.destroy_process_group()
    except Exception as exc:
        message = f"rank {rank} ({where}): {type(exc).__name__}: {exc}"
        with open(os.path.join(spec.workdir, f"error.rank{rank}.txt"), "w") as f:
            f.write(message + "\n" + traceback.format_exc())
        raise RuntimeError(f"bench optim[{message}]") from exc


# ---------------------------------------------------------------------------- the launcher


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, backend: str, spec: Spec) -> str | None:
    """Spawn ``world`` ranks and wait for them; ``None`` on success, else what failed.

    A rank that raises or dies stops the others (torch's spawn context terminates them); a run
    past ``spec.timeout_s`` is killed.
    """
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), backend, spec),
                             nprocs=world, join=False, start_method="spawn")
    stop_at = time.monotonic() + spec.timeout_s
    failure = None
    try:
        while not ctx.join(timeout=1.0, grace_period=5.0):
            if time.monotonic() > stop_at:
                alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                failure = (f"ranks {alive} still running after {spec.timeout_s:.0f} s (a hang or "
                           f"a too small --timeout); stopped them")
                break
    except mp.ProcessRaisedException as exc:
        failure = f"rank {exc.error_index} raised"
    except mp.ProcessExitedException as exc:
        failure = f"rank {exc.error_index} exited with code {exc.exit_code} (killed? out of memory?)"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()  # only the ranks started here
                proc.join()
    if failure is None:
        return None
    if all(os.path.exists(os.path.join(spec.workdir, f"done.rank{r}")) for r in range(world)):
        print(f"bench optim --world {world}: warning: every rank finished, then {failure} while "
              f"shutting down; the results are complete", file=sys.stderr, flush=True)
        return None
    details = []
    for r in range(world):
        path = os.path.join(spec.workdir, f"error.rank{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                details.append(f.read().rstrip())
    return "\n".join([failure] + details)


def run(cfg: GPTConfig, batch: int, accums: list[int], setups: list[Setup], steps: int,
        world: int, workdir: str, nvme_steps: int = 2, cpu_threads: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Time every setup on ``world`` spawned ranks; return rank 0's rows.

    Rows have ``setup``, ``tokens`` (per step, all ranks), ``ms``, ``x``, ``peak_gib`` (``None``
    on the CPU), ``gpu_bytes``, ``off_bytes``, ``host_bytes``, ``unsharded_bytes``, ``share``,
    ``loss``, ``losses`` (every step, the warm-up first) and ``ms_per_rank``. ``workdir`` holds
    the per-rank spill directories and the results.

    Raises:
        ValueError: ``world`` < 2, or more ranks than CUDA GPUs.
        RankFailed: a rank failed or the run passed ``timeout_s``; the message names the
            rank(s) and holds their tracebacks (rows finished before are in ``exc.rows``).
    """
    backend = check_world(world)
    if world < 2:
        raise ValueError(f"--world={world}: the distributed benchmark needs 2 or more ranks; "
                         f"use tiermem.apps.bench.optim.run for one process")
    spec = Spec(cfg=asdict(cfg), batch=batch, accums=list(accums), setups=list(setups),
                steps=steps, nvme_steps=nvme_steps, cpu_threads=cpu_threads, workdir=workdir,
                timeout_s=timeout_s)
    failure = _launch(world, backend, spec)
    path = os.path.join(workdir, "rows.json")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    if failure is not None:
        raise RankFailed(f"bench optim --world {world}: {failure}", rows)
    return rows


def format_table(rows: list[dict], header: bool = True) -> str:
    """Render rows as a fixed-width table (GiB = 2**30 bytes; see the module docstring)."""
    lines = [(f"{'setup':<30}{'tokens/step':>12}{'ms/step':>10}{'x':>8}{'peak GiB':>10}"
              f"{'state GPU':>11}{'state off':>11}{'unsharded':>11}{'share':>7}{'loss':>9}")] \
        if header else []
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(f"{r['setup']:<30}{r['tokens']:>12}{r['ms']:>10.1f}{r['x']:>7.2f}x"
                     f"{peak:>10}{gib(r['gpu_bytes']):>11}{gib(r['off_bytes']):>11}"
                     f"{gib(r['unsharded_bytes']):>11}{r['share']:>7.3f}{r['loss']:>9.4f}")
    return "\n".join(lines)


def main_dist(args: argparse.Namespace) -> int:
    """``tiermem bench optim --world N`` with N > 1, from ``tiermem.apps.bench.optim.main``'s parsed
    arguments; prints the table and returns the exit code (1: a rank failed).

    Raises:
        ValueError: ``--world`` < 1 or above the CUDA GPU count, a bad ``--setups`` item, a
            non-positive ``--grad-accumulation-steps``, ``--steps``, ``--nvme-steps``,
            ``--batch`` or ``--timeout``, a bad model size; each naming the flag.
    """
    cfg = GPTConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                    seq_len=args.seq, vocab=args.vocab)
    cuda = check_world(args.world) == "nccl"
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    setups = parse_setups(args.setups)
    try:
        accums = [int(a) for a in args.accum.split(",")]
    except ValueError:
        accums = [0]
    if min(accums) < 1:
        raise ValueError(f"--grad-accumulation-steps={args.accum!r} must be comma-separated "
                         f"ints >= 1")
    for flag, value in (("--steps", args.steps), ("--nvme-steps", args.nvme_steps),
                        ("--batch", args.batch), ("--timeout", timeout)):
        if value <= 0:
            raise ValueError(f"{flag}={value} must be > 0")
    where = (f"nccl on {args.world} x {torch.cuda.get_device_name()}" if cuda
             else f"gloo on the CPU, {args.world} ranks")
    print(f"bench optim --world {args.world}: GPT {cfg.num_params() / 1e9:.2f}B params, "
          f"micro-batch {args.batch} x {args.seq} tokens per rank, {where}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as tmp:
        try:
            rows = run(cfg, args.batch, accums, setups, args.steps, args.world, tmp,
                       args.nvme_steps, args.cpu_threads, timeout)
        except RankFailed as exc:
            if exc.rows:
                print(format_table(exc.rows))
            print(f"tiermem bench optim: error: {exc}", file=sys.stderr, flush=True)
            return 1
    print(format_table(rows))
    print("state GPU / state off / unsharded: GiB of fp32 masters + Adam moments per rank (max "
          "over ranks) on and off the GPU, and in one process; share: per-rank state / "
          "unsharded")
    return 0
